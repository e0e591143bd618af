"""Fusion plans (deterministic buckets under a threshold) and fused all-reduces through real
reducers, ranks as threads."""

import numpy as np
import pytest

import reduction_server.client as rs
from helpers.jobs import run_job
from reduction_server.client.fusion import FusedAllReduce, FusionPlan, TensorSpec, fusion_threshold
from reduction_server.config.settings import DEFAULT_FUSION_THRESHOLD
from reduction_server.wire.protocol import DType

F32, F16, I64 = DType.FLOAT32, DType.FLOAT16, DType.INT64


def specs(*items):
    return [TensorSpec(f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(items)]


# -- the plan ------------------------------------------------------------------------------
def test_threshold_from_the_environment():
    assert fusion_threshold({}) == DEFAULT_FUSION_THRESHOLD == 64 << 20
    assert fusion_threshold({"HOROVOD_FUSION_THRESHOLD": "1048576"}) == 1 << 20
    assert fusion_threshold({"RS_FUSION_THRESHOLD": "4096", "HOROVOD_FUSION_THRESHOLD": "1048576"}) == 4096
    assert fusion_threshold({"HOROVOD_FUSION_THRESHOLD": "0"}) == 0
    with pytest.raises(rs.ConfigError, match="RS_FUSION_THRESHOLD"):
        fusion_threshold({"RS_FUSION_THRESHOLD": "lots"})


def test_buckets_fill_up_to_the_threshold_in_order():
    plan = FusionPlan(specs(((10,), F32), ((20,), F32), ((30,), F32), ((5, 2), F32)), threshold=200)
    # 40 + 80 bytes fit in 200; +120 would not; then 120 + 40 fit.
    assert [[s.name for s in b.specs] for b in plan.buckets] == [["t0", "t1"], ["t2", "t3"]]
    assert [b.offsets for b in plan.buckets] == [[0, 10], [0, 30]]
    assert [b.count for b in plan.buckets] == [30, 40]


def test_dtypes_never_share_a_bucket_and_big_tensors_stand_alone():
    plan = FusionPlan(specs(((4,), F32), ((4,), F16), ((4,), F16), ((1000,), F16), ((4,), I64)), threshold=64)
    assert [(b.dtype, [s.name for s in b.specs]) for b in plan.buckets] == [
        (F32, ["t0"]),
        (F16, ["t1", "t2"]),
        (F16, ["t3"]),
        (I64, ["t4"]),
    ]


def test_threshold_zero_means_one_bucket_per_tensor():
    plan = FusionPlan(specs(((4,), F32), ((4,), F32), ((1,), F32)), threshold=0)
    assert len(plan.buckets) == 3


def test_plans_are_deterministic_and_fingerprints_tell_lists_apart():
    items = [((3, 4), F32), ((7,), F16), ((2,), F32)]
    a, b = FusionPlan(specs(*items), 1024), FusionPlan(specs(*items), 1024)
    assert a.fingerprint == b.fingerprint
    assert [[s.name for s in x.specs] for x in a.buckets] == [[s.name for s in x.specs] for x in b.buckets]
    for other in (
        FusionPlan(specs(*items), 2048),
        FusionPlan(specs(*items[::-1]), 1024),
        FusionPlan(specs(((4, 3), F32), *items[1:]), 1024),
        FusionPlan(specs(*items[:2]), 1024),
    ):
        assert other.fingerprint != a.fingerprint


def test_duplicate_names_and_unknown_names_are_errors():
    with pytest.raises(rs.ConfigError, match="t0"):
        FusionPlan([TensorSpec("t0", (1,), F32), TensorSpec("t0", (2,), F32)], 64)
    with pytest.raises(KeyError, match="nope"):
        FusionPlan(specs(((1,), F32)), 64).locate("nope")


# -- fused all-reduce through reducers -------------------------------------------------------


def ranks(group, world, body, **options):
    return run_job(world, body, group=group, timeout=10, connect_timeout=10, **options)


ITEMS = [((3, 5), F32), ((1000,), F32), ((7,), F16), ((64, 64), F32), ((11,), I64), ((2,), F32)]


def rank_tensor(spec, rank):
    rng = np.random.default_rng([len(spec.name), rank, spec.count])
    return (rng.uniform(-10, 10, spec.shape) if spec.dtype.is_float else rng.integers(-99, 99, spec.shape)).astype(
        spec.dtype.storage
    )


@pytest.mark.parametrize("world", [2, 3])
def test_fused_results_equal_a_plain_all_reduce_per_tensor(group, world):
    plan = FusionPlan(specs(*ITEMS), threshold=4096)
    assert len(plan.buckets) > 3  # several buckets, some holding several tensors

    def body(comm, rank):
        step = FusedAllReduce(comm, plan, op="avg")
        for spec in reversed(plan.specs):  # gradients arrive in reverse, as in a backward pass
            step.ready(spec.name, rank_tensor(spec, rank))
        fused = step.wait()
        plain = {s.name: comm.all_reduce(rank_tensor(s, rank), op="avg") for s in plan.specs}
        return fused, plain

    for fused, plain in ranks(group, world, body):
        for spec in plan.specs:
            assert fused[spec.name].shape == spec.shape
            if spec.dtype.is_float:  # float sums depend on the order contributions arrive in
                rtol = 2e-3 if spec.dtype is F16 else 1e-6
                np.testing.assert_allclose(fused[spec.name], plain[spec.name], rtol=rtol, atol=1e-5)
            else:
                np.testing.assert_array_equal(fused[spec.name], plain[spec.name])


def test_a_bucket_starts_as_soon_as_its_tensors_are_ready(group):
    plan = FusionPlan(specs(((8,), F32), ((8,), F32), ((8,), F32)), threshold=32)  # one tensor per bucket

    def body(comm, rank):
        step = FusedAllReduce(comm, plan)
        step.ready("t2", np.ones(8, np.float32))
        first = step.started()
        step.ready("t0", np.ones(8, np.float32))
        second = step.started()
        step.ready("t1", np.ones(8, np.float32))
        return first, second, step.wait()

    for first, second, out in ranks(group, 2, body):
        assert first == [2] and second == [0, 2]
        assert all(np.all(v == 2) for v in out.values())


def test_ranks_with_different_plans_fail_naming_them(group):
    def body(comm, rank):
        items = ITEMS if rank != 2 else ITEMS[:-1]  # rank 2 forgot a tensor
        with pytest.raises(rs.CollectiveError, match=r"ranks \[2\] built a different fusion plan") as info:
            FusedAllReduce(comm, FusionPlan(specs(*items), threshold=4096))
        return str(info.value)

    for message in ranks(group, 3, body):
        assert "rank 0: 6 tensors" in message and "rank 2: 5 tensors" in message


def test_wrong_tensors_are_refused(group):
    plan = FusionPlan(specs(((4,), F32), ((2,), F32)), threshold=1024)

    def body(comm, rank):
        step = FusedAllReduce(comm, plan)
        with pytest.raises(ValueError, match="t0.*plan says"):
            step.ready("t0", np.ones(5, np.float32))
        with pytest.raises(ValueError, match="t0.*plan says"):
            step.ready("t0", np.ones(4, np.float64))
        with pytest.raises(ValueError, match="missing"):
            step.wait()
        step.ready("t0", np.ones(4, np.float32))
        with pytest.raises(ValueError, match="already given"):
            step.ready("t0", np.ones(4, np.float32))
        step.ready("t1", np.ones(2, np.float32))
        return step.wait()

    for out in ranks(group, 2, body):
        assert np.all(out["t0"] == 2) and np.all(out["t1"] == 2)
