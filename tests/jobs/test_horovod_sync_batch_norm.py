"""hvd.SyncBatchNorm (reduction_server.client.horovod.torch) through real reducers and real rank
processes (W=2 and W=3; W=1 for the one-rank path, plain BatchNorm): every rank holds a slice of
one batch (evenly split, unevenly, or none at all on one rank), and the forward output, the input
gradient, the weight and bias gradients summed over the ranks, and the running mean and variance
equal one torch.nn.BatchNorm1d/2d in one process on the whole batch; in eval mode the layer
normalizes with its running stats. W=3 also runs a layer on the process set of ranks 0 and 2."""

import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the adapter needs it")

from helpers.cluster import SCRIPTS, once, reducers, run_workers  # noqa: E402

sys.path.insert(0, str(SCRIPTS))
import horovod_sync_batch_norm_worker as worker  # noqa: E402

TOL = 1e-5
_results = {}


def run_job(world):
    def run():
        with reducers(max(world - 1, 1), workers=world) as group:  # W=1, 2: one reducer, W=3: two
            return run_workers(world, group, "horovod_sync_batch_norm_worker.py", [], timeout=150)

    return once(_results, world, run)


@pytest.fixture(params=[1, 2, 3], ids=lambda w: f"W{w}")
def job(request):
    return request.param, run_job(request.param)


def reference(case, world):
    """One process, the whole batch: per step the output, the input gradient, the weight and bias
    gradients and the running stats after it; then the eval output on the next batch."""
    channels = worker.CASES[case]["sample"][0]
    module = torch.nn.BatchNorm1d if len(worker.CASES[case]["sample"]) == 1 else torch.nn.BatchNorm2d
    bn = module(channels, **worker.layer_args(case))
    if bn.affine:
        weight, bias = worker.parameters(case)
        with torch.no_grad():
            bn.weight.copy_(weight)
            bn.bias.copy_(bias)
    steps = []
    for step in range(worker.STEPS):
        x, grad = worker.batch(case, world, step)
        x.requires_grad_()
        bn.zero_grad(set_to_none=True)
        out = bn(x)
        (out * grad).sum().backward()
        seen = {
            "out": out,
            "x_grad": x.grad,
            "weight": bn.weight.grad if bn.affine else None,
            "bias": bn.bias.grad if bn.affine else None,
            "running_mean": bn.running_mean,
            "running_var": bn.running_var,
        }
        steps.append({k: None if v is None else v.detach().clone() for k, v in seen.items()})
        steps[-1]["batches"] = None if bn.num_batches_tracked is None else int(bn.num_batches_tracked)
    bn.eval()
    x, _ = worker.batch(case, world, worker.STEPS)
    with torch.no_grad():
        evaluated = bn(x)
    return steps, x, evaluated, bn


def close(got, want, what):
    got = torch.tensor(got, dtype=torch.float32).reshape(want.shape)
    assert torch.allclose(got, want, rtol=TOL, atol=TOL), (what, float((got - want).abs().max()))


def rank_slice(case, world, rank):
    sizes = worker.rows(case, world)
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def check_training(case, world, rank, got, where):
    """One rank's steps of `case` against the reference over `world` ranks' whole batch."""
    steps, _, _, _ = reference(case, world)
    mine = rank_slice(case, world, rank)
    assert len(got) == len(steps)
    for step, (g, want) in enumerate(zip(got, steps)):
        at = f"{where} step {step}"
        close(g["out"], want["out"][mine], f"{at}: output")
        close(g["x_grad"], want["x_grad"][mine], f"{at}: input gradient")
        for name in ("weight", "bias"):
            if want[name] is None:
                assert name not in g, at
            else:
                close(g[name], want[name], f"{at}: {name} gradient summed over the ranks")
        for name in ("running_mean", "running_var"):
            if want[name] is None:
                assert g[name] is None, at
            else:
                close(g[name], want[name], f"{at}: {name}")
        assert g["batches"] == want["batches"], at


@pytest.mark.parametrize("case", list(worker.CASES))
def test_training_matches_one_batch_norm_on_the_whole_batch(job, case):
    world, results = job
    for r in results:
        check_training(case, world, r["rank"], r["cases"][case]["steps"], f"{case} rank {r['rank']}")


def test_a_process_set_shares_statistics_among_its_ranks(job):
    """W=3, a layer on the process set of ranks 0 and 2: their slices make the whole batch, rank 1
    takes no part."""
    world, results = job
    if world != 3:
        pytest.skip("the process set is [0, 2] of three ranks")
    case = worker.PROCESS_SET_CASE
    assert "process_set" not in results[1]
    for member, r in enumerate([results[0], results[2]]):
        got = r["process_set"]
        check_training(case, 2, member, got["steps"], f"process set: {case} rank {r['rank']}")
        _, _, evaluated, _ = reference(case, 2)
        close(got["eval"], evaluated[rank_slice(case, 2, member)], f"process set rank {r['rank']}: eval output")


def test_the_statistics_span_the_ranks(job):
    """Not each rank's own statistics: a rank's output differs from a BatchNorm of its slice alone."""
    world, results = job
    if world == 1:
        pytest.skip("one rank: its slice is the whole batch")
    case = "4d_uneven"
    x, _ = worker.batch(case, world, 0)
    for r in results:
        mine = rank_slice(case, world, r["rank"])
        local = torch.nn.BatchNorm2d(x.shape[1], **worker.layer_args(case))
        weight, bias = worker.parameters(case)
        with torch.no_grad():
            local.weight.copy_(weight)
            local.bias.copy_(bias)
            alone = local(x[mine])
        got = torch.tensor(r["cases"][case]["steps"][0]["out"]).reshape(alone.shape)
        assert not torch.allclose(got, alone, rtol=1e-3, atol=1e-3), r["rank"]


@pytest.mark.parametrize("case", list(worker.CASES))
def test_eval_mode_uses_the_running_stats(job, case):
    world, results = job
    _, x, evaluated, bn = reference(case, world)
    for r in results:
        mine = rank_slice(case, world, r["rank"])
        got = r["cases"][case]["eval"]
        close(got, evaluated[mine], f"{case} rank {r['rank']}: eval output")
        if not bn.track_running_stats:
            continue  # no running stats: the whole batch's statistics, as torch's BatchNorm in eval mode
        # The running stats this rank reported after its last step, and nothing of the batch.
        last = r["cases"][case]["steps"][-1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = torch.tensor(last["running_mean"]).view(shape)
        var = torch.tensor(last["running_var"]).view(shape)
        weight, bias = worker.parameters(case)
        want = (x[mine] - mean) / torch.sqrt(var + bn.eps) * weight.view(shape) + bias.view(shape)
        close(got, want, f"{case} rank {r['rank']}: eval output from the running stats")


def test_input_must_be_at_least_2d(job):
    _, results = job
    for r in results:
        assert r["1d_input"] == "expected at least 2D input (got 1D input)"


def test_the_job_ran_on_every_rank(job):
    world, results = job
    assert [(r["rank"], r["size"]) for r in results] == [(k, world) for k in range(world)]
