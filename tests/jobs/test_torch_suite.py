"""PyTorch's own distributed test suite (DistributedTest._DistTestBase, shipped in the torch
wheel) against the reduction_server backend, at W=2 and W=3 on real reducers
(tests/scripts/torch_suite.py runs it as third-party backends do).

Every test it runs must pass. A test may be skipped only by torch itself for want of CUDA, of
world size or of another backend's feature (its own words, matched below), or by this
project's list of what the backend does not do yet (UNSUPPORTED in scripts/torch_suite.py, each
skipped with "reduction_server: <why>"). CI runs a selection that covers every collective;
`pytest --torch-suite=all` runs the whole suite (about a minute per world size here).
"""

import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytest.importorskip("expecttest", reason="torch's test suite needs expecttest (pip install '.[test]')")

from helpers.cluster import SCRIPTS, TOKEN, child_env, reducers  # noqa: E402

# The selection CI runs: every collective of the API, through torch's own checks.
SELECTION = {
    "all_reduce": [
        "test_all_reduce_sum",
        "test_all_reduce_sum_async",
        "test_all_reduce_product",
        "test_all_reduce_min",
        "test_all_reduce_max",
        "test_all_reduce_sum_complex",
        "test_all_reduce_complex_unsupported_ops",
        "test_all_reduce_full_group_sum",
    ],
    "all_reduce_coalesced": [
        "test_all_reduce_coalesced_sum",
        "test_all_reduce_coalesced_max",
        "test_all_reduce_coalesced_max_complex_unsupported",
    ],
    "sparse all_reduce": ["test_sparse_all_reduce_sum"],
    "reduce": [
        "test_reduce_sum",
        "test_reduce_product",
        "test_reduce_max",
        "test_reduce_full_group_min",
        "test_reduce_sum_twice",
    ],
    "broadcast": ["test_broadcast", "test_broadcast_full_group"],
    "all_gather": [
        "test_all_gather",
        "test_all_gather_complex",
        "test_all_gather_full_group",
        "test_all_gather_object_default_pg",
    ],
    "all_gather_coalesced": ["test_all_gather_coalesced_simple", "test_all_gather_coalesced_with_empty"],
    "gather": ["test_gather", "test_gather_checks", "test_gather_full_group", "test_gather_object"],
    "scatter": [
        "test_scatter",
        "test_scatter_checks",
        "test_scatter_complex",
        "test_scatter_full_group",
        "test_scatter_object_list",
    ],
    "all_to_all": ["test_all_to_all", "test_all_to_all_full_group"],
    "all_to_all_single": [
        "test_all_to_all_single_equal_split",
        "test_all_to_all_single_unequal_split",
        "test_all_to_all_single_equal_split_complex",
    ],
    "barrier": ["test_barrier", "test_barrier_full_group"],
    "groups": [
        "test_get_rank_size_full_group",
        "test_destroy_full_group",
        "test_get_backend",
        "test_destroy_group",
        "test_get_rank_size_group",
    ],
    "send/recv": [
        "test_send_recv",
        "test_send_recv_with_tag",
        "test_isend",
        "test_irecv",
        "test_batch_isend_irecv_gloo",
        "test_batch_isend_irecv_gloo_tags",
    ],
    "ddp": ["test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view"],
}

# torch's own reasons for a skip that says nothing about this backend's collectives.
TORCH_SKIPS = re.compile(
    "|".join(
        [
            r"CUDA",
            r"cuda",
            r"GPU",
            r"gpu",
            r"world size",
            r"worldsize",
            r"Skipped due to small world size",
            r"Only (Nccl|NCCL|Gloo|gloo|MPI|mpi|Gloo and NCCL|Gloo and Nccl|Nccl and Gloo|NCCL and GLOO)[ a-zA-Z_]* "
            r"(support|backend|will)",
            r"Test requires backend \S+ to be one of",
            r"only supported on",
            r"Only gloo backend supports",
            r"is only implemented for",
            r"Requires file:// initialization",
            r"NCCL",
            r"Nccl",
            r"DETAIL debug mode",
            r"torch.compile",
            r"Requires (at least|exact)",
            r"Need at least",
            r"Test is (only|not)",
            r"ROCm",
            r"sandcastle",
            r"multi-gpu",
            r"not supported on",
            r"^https://github.com/pytorch/pytorch/issues/\d+$",
            r"^Test is failing, see https://github.com/pytorch/",  # torch disables it
            r"^no torchvision$",  # torch's own check for a package this machine has no build of
        ]
    )
)


def _suite_tests(option: str) -> List[str]:
    if option == "all":
        return []  # no selection: every test of the suite
    return [name for names in SELECTION.values() for name in names]


def _run(world: int, tests: List[str], tmp_path: Path, spec: str) -> Dict[str, tuple]:
    """Run the suite at `world`; each test's outcome: ("passed" | "skipped" | "failed", message)."""
    report = tmp_path / f"suite-w{world}.xml"
    temp = tmp_path / f"temp-w{world}"
    temp.mkdir()
    env = child_env(
        {
            "BACKEND": "reduction_server",
            "WORLD_SIZE": str(world),
            "TEMP_DIR": str(temp),
            "RS_REDUCERS": spec,
            "RS_JOB_TOKEN": TOKEN,
            "RS_TIMEOUT": "30",
            "RS_CONNECT_TIMEOUT": "30",
            "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
        }
    )
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    targets = [f"torch_suite.py::TestBackend::{name}" for name in tests] or ["torch_suite.py"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",  # not this project's options (its workers): the suite's ranks are torch's
            f"--junitxml={report}",
            *targets,
        ],
        cwd=SCRIPTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert report.exists(), (
        f"the suite did not run (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = case.get("name")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            outcomes[name] = ("failed", (failed.get("message") or "")[:400])
        elif skipped is not None:
            outcomes[name] = ("skipped", skipped.get("message") or "")
        else:
            outcomes[name] = ("passed", "")
    return outcomes


@pytest.fixture(scope="module")
def suite(request, tmp_path_factory):
    """Each world size's outcomes, from one run of the suite over one reducer pair."""
    option = request.config.getoption("--torch-suite")
    tests = _suite_tests(option)
    results = {}
    with reducers(2) as group:
        for world in (2, 3):
            results[world] = _run(world, tests, tmp_path_factory.mktemp(f"suite{world}"), group.spec)
        assert group.alive(), "a reducer died during torch's test suite"
    return option, tests, results


@pytest.mark.timeout(6000)
@pytest.mark.parametrize("world", [2, 3])
def test_every_test_torch_runs_passes(suite, world):
    option, tests, results = suite
    outcomes = results[world]
    if tests:
        assert set(outcomes) == set(tests), f"tests missing from the run: {set(tests) - set(outcomes)}"
    failed = {name: message for name, (state, message) in outcomes.items() if state == "failed"}
    assert not failed, f"W={world}: {len(failed)} of torch's tests failed: {failed}"
    unexplained = {
        name: message
        for name, (state, message) in outcomes.items()
        if state == "skipped" and not message.startswith("reduction_server: ") and not TORCH_SKIPS.search(message)
    }
    assert not unexplained, f"W={world}: skipped without a reason torch or UNSUPPORTED gives: {unexplained}"
    passed = sorted(name for name, (state, _) in outcomes.items() if state == "passed")
    print(
        f"W={world} ({option}): {len(passed)} passed, "
        f"{sum(state == 'skipped' for state, _ in outcomes.values())} skipped"
    )


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_is_exercised_by_a_passing_test(suite, world):
    """The CI selection is not vacuous: each collective has a test of torch's that ran and passed."""
    option, tests, results = suite
    outcomes = results[world]
    for collective, names in SELECTION.items():
        ran = [name for name in names if outcomes.get(name, ("", ""))[0] == "passed"]
        assert ran, f"W={world}: no test of {collective} passed: {[(n, outcomes.get(n)) for n in names]}"
