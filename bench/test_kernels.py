"""pytest-benchmark suite: every dtype x op, our kernels beside NumPy in the same run.

    pytest bench/test_kernels.py --benchmark-group-by=group     # or: reduction-server bench kernels

RS_BENCH_KERNEL_MIB (comma-separated accumulator sizes in MiB, default "4,64") picks the sizes.
The "int8-blocks" rows' NumPy column is a float32 add of as many elements (kernel_cases.int8_case).
"""

import pytest

from reduction_server.bench.kernel_cases import OPS, case, int8_case
from reduction_server.config import settings
from reduction_server.wire.protocol import DType

SIZES_MIB = [float(s) for s in settings.read("RS_BENCH_KERNEL_MIB").split(",")]


@pytest.mark.parametrize("mib", SIZES_MIB)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name.lower())
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name.lower())
@pytest.mark.parametrize("impl", ["native", "numpy"])
def test_kernel(benchmark, impl, op, dtype, mib):
    ours, theirs, nbytes = case(dtype, op, int(mib * (1 << 20)))
    benchmark.group = f"{dtype.name.lower()} {op.name.lower()} {mib:g} MiB"
    benchmark.extra_info.update(impl=impl, dtype=dtype.name.lower(), op=op.name.lower(), mib=mib, nbytes=nbytes)
    benchmark(ours if impl == "native" else theirs)


@pytest.mark.parametrize("mib", SIZES_MIB)
@pytest.mark.parametrize("impl", ["native", "numpy"])
def test_int8_kernel(benchmark, impl, mib):
    ours, theirs, nbytes = int8_case(int(mib * (1 << 20)))
    benchmark.group = f"int8-blocks sum {mib:g} MiB"
    benchmark.extra_info.update(impl=impl, dtype="int8-blocks", op="sum", mib=mib, nbytes=nbytes)
    benchmark(ours if impl == "native" else theirs)
