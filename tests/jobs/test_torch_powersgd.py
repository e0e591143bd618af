"""torch's own PowerSGD DDP comm hooks over the reduction_server backend, through real reducers
and two real ranks: their callbacks issue and wait on further collectives, and training ends
where gloo's does. Also a plain Future callback that waits on a collective it issues."""

import json
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the adapter needs it")
dist = pytest.importorskip("torch.distributed", reason="this torch build has no torch.distributed")
if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

from helpers.cluster import SCRIPTS, once, reducers, run_workers  # noqa: E402
from helpers.ports import free_ports  # noqa: E402

sys.path.insert(0, str(SCRIPTS))
import torch_model  # noqa: E402

WORLD = 2
HOOKS = ("powersgd", "batched")
TASKS = ["then", *(f"{backend}:{hook}" for hook in HOOKS for backend in ("gloo", "rs"))]
DEADLINE = 60  # seconds a rank may take before it prints its threads' stacks and exits
_results = {}


def job():
    """Every rank's results, from one job run once per session."""

    def run():
        spec = {"tasks": TASKS, "master_ports": free_ports(len(TASKS))}
        with reducers(1, workers=WORLD) as group:
            return run_workers(
                WORLD,
                group,
                "torch_powersgd.py",
                [json.dumps(spec)],
                extra_env={"RS_TEST_DEADLINE": str(DEADLINE)},
                timeout=DEADLINE + 30,
            )

    return once(_results, "job", run)


def test_a_callback_that_waits_on_a_collective_it_issues_completes():
    outer, inner = [1.0 + 2.0] * 4, [10.0 + 20.0] * 3
    for r in job():
        assert r["then"] == [outer, inner], r["rank"]


@pytest.mark.parametrize("hook", HOOKS)
def test_powersgd_training_ends_where_gloo_does(hook):
    results = job()
    start = torch.cat([p.detach().reshape(-1) for p in torch_model.make_model(seed=1000).parameters()])
    gloo = torch.tensor(results[0][f"gloo:{hook}"])
    assert not torch.allclose(gloo, start), "training did not move the weights"
    for r in results:
        got = torch.tensor(r[f"rs:{hook}"])
        assert torch.equal(torch.tensor(r[f"gloo:{hook}"]), gloo), f"gloo's ranks disagree ({hook})"
        err = float((got - gloo).abs().max())
        assert torch.allclose(got, gloo, rtol=1e-5, atol=1e-5), f"rank {r['rank']}: {hook} vs gloo: max error {err}"
