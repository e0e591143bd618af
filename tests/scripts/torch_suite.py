"""PyTorch's own distributed test suite (DistributedTest._DistTestBase, shipped in the torch
wheel) against the reduction_server backend, as third-party backends run it (torch_ucc's
test/torch_tests.py): the backend is named in DistTestCases' feature sets and the suite's
TestDistBackend starts WORLD_SIZE ranks per test.

Run by tests/jobs/test_torch_suite.py with BACKEND, WORLD_SIZE, TEMP_DIR and RS_REDUCERS set; each test
gets a generation of its own (RS_GENERATION), so that its ranks never meet an earlier test's
rounds on the reducers.

The ranks are forked from this process, as torch's own CPU suite ran them (test_distributed_fork,
until CUDA made spawn its only way): spawned, each rank of each test imports torch and the suite
again, 3-5 s a test on a 2-core machine against under one forked. This process runs no collective
and starts no engine before it forks (as torch's DataLoader forks its workers after torch is
imported); the backend is registered on import here, and so in every rank.
"""

import functools
import itertools
import os
import re
import time
import unittest

import torch.multiprocessing
from torch.testing._internal.common_distributed import DistTestCases
from torch.testing._internal.common_utils import run_tests

import reduction_server.client.torch  # noqa: F401  (registers the backend)

BACKEND = os.environ["BACKEND"]
if BACKEND != "gloo":  # the peer runs the same selection unchanged
    for feature in ("plugin", "ddp"):
        DistTestCases.backend_feature[feature].add(BACKEND)

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

#: torch's tests of what the backend does not do yet, and why; each is skipped saying so
UNSUPPORTED = {
    name: (
        "a receive from any source cannot be matched by the reducers, which relay each message "
        "within its pair of ranks; the backend raises NotImplementedError naming the way out"
    )
    for name in [
        "test_send_recv_any_source",
        "test_send_recv_any_source_autograd_profiler",
        "test_send_recv_any_source_torch_profiler",
    ]
}

#: torch's tests that torch gates to other backends (by name, not by what they need) and that
#: exercise what this one does: run here with their gates taken off
RUN_ANYWAY = [
    "test_all_to_all",
    "test_all_to_all_complex",
    "test_all_to_all_full_group",
    "test_all_to_all_single_equal_split",
    "test_all_to_all_single_equal_split_complex",
    "test_all_to_all_single_unequal_split",
    "test_all_to_all_single_unequal_split_complex",
    "test_all_to_all_single_equal_split_full_group",
    "test_all_to_all_single_unequal_split_full_group",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_full_group_sum",
    "test_all_gather_object_default_pg",
    "test_gather_object",
    "test_scatter_object_list",
    "test_sparse_all_reduce_sum",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
]


def _ungated(test):
    """test without the skip mark its backend-name gate set (its other checks stay); a test that
    torch skips for another reason (one it marks as failing) is not to be run."""
    why = getattr(test, "__unittest_skip_why__", "")
    if not re.search(r"Only (MPI|Gloo|gloo) |Test requires backend|^GLOO Batch Send Recv CPU$", why):
        raise ValueError(f"RUN_ANYWAY names {test.__name__}, which torch skips for another reason: {why!r}")

    @functools.wraps(test)
    def run(self):
        return test(self)

    run.__unittest_skip__ = False
    return run


# Newer than any generation the reducers served before: tenths of a second since 2023-11 (a test
# takes longer than that; the header's 32 bits last until 2037).
_generations = itertools.count(int(time.time() * 10) - 17_000_000_000)


class TestBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        os.environ["RS_GENERATION"] = str(next(_generations))
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


for _name in RUN_ANYWAY:
    setattr(TestBackend, _name, _ungated(getattr(DistributedTest._DistTestBase, _name)))
for _name, _reason in UNSUPPORTED.items():
    if not hasattr(DistributedTest._DistTestBase, _name):
        raise AttributeError(f"UNSUPPORTED names {_name}, which torch's suite does not have")
    setattr(TestBackend, _name, unittest.skip(f"reduction_server: {_reason}")(getattr(TestBackend, _name)))


if __name__ == "__main__":
    run_tests()
