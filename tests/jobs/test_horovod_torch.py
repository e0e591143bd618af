"""The Horovod-style PyTorch API (reduction_server.client.horovod.torch) through real reducers and
real rank processes: collectives matched by name across ranks that submit in different orders,
DistributedOptimizer training equal to a single process on the concatenated batch, the initial
broadcast, and the example under the launcher."""

import json
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the adapter needs it")

from helpers import int8_blocks as ref  # noqa: E402
from helpers.cluster import SCRIPTS, once, reducers, run_example, run_workers  # noqa: E402
from helpers.devices import TOLERANCE, label, on_device  # noqa: E402
from reduction_server.config import settings  # noqa: E402

sys.path.insert(0, str(SCRIPTS))
import horovod_torch_worker  # noqa: E402
import torch_model  # noqa: E402

#: int8 blocks against float32's weights after 5 steps: measured 2e-4 with error feedback, 4e-4 without
INT8_TOLERANCE = (1e-3, 5e-4)

# Training configurations each rank runs, by name (see horovod_torch_worker.py).
CONFIGS = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "accumulate": {"passes": 2},
    "predivide": {"predivide": 2.0},
    "fp16": {"fp16": True},
    "int8": {"int8": True},
    "int8_no_feedback": {"int8": True, "error_feedback": False},
    "sum": {"op": "sum"},
    "explicit_sync": {"explicit_sync": True},
}
#: the jobs, by (world size, device); on a GPU machine two ranks share its GPU
JOBS = [(2, "cpu"), (3, "cpu"), (2, "cuda")]
_results = {}


def run_job(key):
    world, device = key
    env = on_device(device)

    def run():
        with reducers(world - 1, workers=world) as group:  # W=2: one reducer, W=3: two
            return run_workers(
                world, group, "horovod_torch_worker.py", [json.dumps(CONFIGS)], extra_env=env, timeout=150
            )

    return once(_results, key, run)


@pytest.fixture(params=JOBS, ids=label)
def job(request):
    world, device = request.param
    return world, device, run_job(request.param)


def reference(world, momentum=0.0):
    """One process, rank 0's initial weights, the concatenated batch."""
    model = torch_model.make_model(seed=1000)
    x, y = torch_model.batch(world)
    torch_model.train(model, x, y, torch_model.STEPS, momentum=momentum)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_training_matches_a_single_process_on_the_whole_batch(job):
    world, device, results = job
    rank0_start = torch.cat([p.detach().reshape(-1) for p in torch_model.make_model(seed=1000).parameters()])
    for name, config in CONFIGS.items():
        expected = reference(world, config.get("momentum", 0.0))
        rtol, atol = (1e-2, 1e-4) if config.get("fp16") else INT8_TOLERANCE if config.get("int8") else TOLERANCE[device]
        for r in results:
            run = r["train"][name]
            # Ranks seeded differently start from rank 0's weights after broadcast_parameters.
            assert torch.equal(torch.tensor(run["initial"]), rank0_start), (name, r["rank"])
            final = torch.tensor(run["final"])
            assert torch.allclose(final, expected, rtol=rtol, atol=atol), (
                name,
                r["rank"],
                float((final - expected).abs().max()),
            )
            assert run["final"] == results[0]["train"][name]["final"], f"{name}: ranks differ"
        if config.get("fp16") or config.get("int8"):
            assert not torch.equal(torch.tensor(results[0]["train"][name]["final"]), expected), (
                f"{name} did not compress"
            )


def test_gradient_all_reduces_start_during_backward(job):
    """When backward reaches the first layer (its gradients come last), the later layers'
    all-reduces have already been handed to the negotiation: communication overlaps backward."""
    _, _, results = job
    for r in results:
        started = r["train"]["plain"]["started_before_first_layer"]
        assert len(started) == 2 * torch_model.STEPS  # two parameters (weight, bias) per backward
        assert all(n >= 4 for n in started[::2]), started  # b and c's weight and bias were started


def test_collectives_matched_by_name(job):
    world, _, results = job
    ranks = range(world)
    values = [[i + r + 1.0 for i in range(6)] for r in ranks]
    expect = {
        "sum": [sum(v[i] for v in values) for i in range(6)],
        "average": [sum(v[i] for v in values) / world for i in range(6)],
        "min": values[0],
        "max": values[-1],
        "product": [float(torch.tensor([v[i] for v in values], dtype=torch.float64).prod()) for i in range(6)],
    }
    total = float(sum(ranks))
    for r in results:
        c = r["collectives"]
        assert (r["rank"], r["size"], r["local_size"], r["cross_size"]) == (results.index(r), world, world, 1)
        assert r["local_rank"] == r["rank"]  # one host
        assert c["ops"].keys() == expect.keys()
        for op, want in expect.items():
            assert c["ops"][op] == pytest.approx(want), op
        assert c["input_untouched"] == values[r["rank"]]
        assert c["inplace"] == [True, [total] * 3]
        assert c["scaled"] == [world * 2 * 0.25] * 2
        assert c["average_flag"] == [total / world] * 2
        assert c["fp16"] == ["torch.float32", [sum(0.5 + k for k in ranks)] * 4]
        assert c["grouped"] == [[total] * 2, [int(total)] * 3]
        assert c["broadcast"] == [[float(world - 1)] * 2] * 2
        assert c["broadcast_input_untouched"] == [[float(r["rank"])] * 2] * 2
        assert c["broadcast_"] == [[1.0] * 2] * 2
        me = r["rank"]
        assert c["default_device"] == [[0.0] * 3, [100 * k + 2 * me + i for k in ranks for i in range(2)]]
        assert c["allgather_bf16"] == ["torch.bfloat16", [[float(k)] * 2 for k in ranks for _ in range(k + 1)]]
        assert c["allgather_bool"] == [k % 2 == 0 for k in ranks]
        assert c["allgather_scalar"] == [10 * k for k in ranks]
        assert c["object"] == {"from": 1, "list": [1, 1, 1]}
        assert c["objects"] == [["rank", k] for k in ranks]
        assert c["function"] == 1 + 100 * (world - 1) and c["functions"] == [k + 1 for k in ranks]
        # An object the root (or a rank) cannot serialize fails there as pickling does, and on
        # the others at once, naming it, instead of leaving them waiting for RS_TIMEOUT.
        unserializable = c["unserializable"]
        for failure, culprit in zip(unserializable, (1, 0)):
            if me == culprit:
                assert failure.startswith("TypeError") and "lock" in failure, failure
            else:
                assert failure == f"HorovodInternalError: rank(s) {culprit} could not serialize the object", failure
        assert c["parameters"] == [[[float(world - 1)] * 2] * 2, [float(world - 1)] * 2]
        assert r["refused"] == "process_sets='static': give a list of ProcessSets, or \"dynamic\""
        shapes = "; ".join(f"ranks [{k}]: [{k + 1}]" for k in ranks)
        assert (
            c["mismatch"] == f"HorovodInternalError: rank {r['rank']}: tensor 'mismatch': ranks disagree on its "
            f"shape: {shapes}"
        )
        assert c["after_mismatch"] == [float(world)]  # a mismatch fails that tensor, not the job


def test_int8_collectives_are_the_decode_sum_encode_and_refuse_what_they_cannot_do(job):
    world, _, results = job
    block = settings.read("RS_INT8_BLOCK")
    inputs = [[t.numpy() for t in horovod_torch_worker.int8_inputs(k)] for k in range(world)]
    summed = ref.allreduced([one for one, _ in inputs], block)
    grouped = ref.allreduced([two for _, two in inputs], block, average=True)
    for r in results:
        dtype, got_sum, got_grouped, counts = r["collectives"]["int8"]
        assert dtype == "torch.float32"
        assert ref.matches(got_sum, summed, world, block)
        assert ref.matches(got_grouped, grouped, world, block)  # 256 | 512: fused or not, the same blocks
        assert counts == [sum(i + k for k in range(world)) for i in range(3)]  # an int64 tensor goes as it is
        disagree = r["collectives"]["int8_disagree"]
        assert disagree.startswith("HorovodInternalError") and "ranks disagree on its compression" in disagree
        assert "int8" in disagree and "none" in disagree, disagree
        assert "reducescatter cannot send Compression.int8" in r["collectives"]["int8_reducescatter"]


def test_int8_optimizer_keeps_a_residual_per_parameter_unless_told_not_to(job):
    _, _, results = job
    sizes = {name: p.numel() for name, p in torch_model.make_model(seed=0).named_parameters()}
    for r in results:
        residuals = r["train"]["int8"]["residuals"]
        assert {name: len(v) for name, v in residuals.items()} == sizes
        assert all(any(v) for v in residuals.values()), "a residual stayed all zeros"
        assert r["train"]["int8_no_feedback"]["residuals"] == {}
    world = len(results)
    expected = reference(world)
    error = {
        name: float((torch.tensor(results[0]["train"][name]["final"]) - expected).abs().max())
        for name in ("int8", "int8_no_feedback")
    }
    assert error["int8"] < error["int8_no_feedback"], error  # about half, measured


def test_gradient_predivide_factor_needs_op_average_as_in_horovod():
    import reduction_server.client.horovod.torch as hvd

    model = torch.nn.Linear(2, 2)
    for op in (hvd.Sum, hvd.Min):
        with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
            hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=model.named_parameters(),
                op=op,
                gradient_predivide_factor=2.0,
            )


def test_example_runs_under_the_launcher(tmp_path):
    out = run_example("horovod_torch.py", "--steps", "3", "--fp16-allreduce", cwd=tmp_path)
    assert "weights identical on all ranks: True" in out, out
