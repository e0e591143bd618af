"""Numerics through real reducers: float16/bfloat16 are accumulated in float32 and rounded once,
which is more accurate than accumulating in the input type (what NCCL does); float32 and float64
sums stay within their accumulation rounding of a float64 reference."""

import ml_dtypes
import numpy as np
import pytest

from helpers.jobs import run_job

WORLD = 8  # enough contributions for 16-bit accumulation error to show


def reduce_everywhere(group, inputs):
    return run_job(
        WORLD, lambda comm, r: comm.all_reduce(inputs[r]), group=group, timeout=30, connect_timeout=30, limit=60
    )


def in_type_sum(inputs):
    """What accumulating in the input type gives: a running sum rounded after every addition."""
    total = inputs[0].copy()
    for x in inputs[1:]:
        total = (total.astype(np.float32) + x.astype(np.float32)).astype(inputs[0].dtype)
    return total


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_16_bit_floats_are_more_accurate_than_accumulating_in_16_bits(group, dtype):
    rng = np.random.default_rng(1)
    # Many small values beside large ones: where rounding after every addition loses most.
    inputs = [(rng.uniform(0, 1, 50_000) * rng.choice([1.0, 0.01], 50_000)).astype(dtype) for _ in range(WORLD)]
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    results = reduce_everywhere(group, inputs)
    for y in results[1:]:
        assert np.array_equal(y.view(np.uint16), results[0].view(np.uint16))  # every rank: the same bits
    ours = np.abs(results[0].astype(np.float64) - exact).mean()
    naive = np.abs(in_type_sum(inputs).astype(np.float64) - exact).mean()
    once = np.abs(exact.astype(dtype).astype(np.float64) - exact).mean()  # the best a 16-bit result can do
    assert ours < 0.75 * naive, (ours, naive)
    assert ours <= 1.05 * once, (ours, once)  # float32 accumulation costs (almost) nothing over one rounding


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 4e-7 * WORLD), (np.float64, 3e-16 * WORLD)])
def test_wide_floats_stay_within_their_accumulation_rounding(group, dtype, rtol):
    rng = np.random.default_rng(2)
    inputs = [rng.uniform(0.5, 1.5, 100_000).astype(dtype) for _ in range(WORLD)]
    exact = np.sum([x.astype(np.longdouble) for x in inputs], axis=0)
    for y in reduce_everywhere(group, inputs):
        assert y.dtype == dtype
        np.testing.assert_allclose(y.astype(np.longdouble), exact, rtol=rtol, atol=0)
