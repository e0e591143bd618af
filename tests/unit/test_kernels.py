"""The native reduction kernels (reduction_server._native, built from native/) against NumPy.

Every test that computes runs once per instruction-set level this CPU supports (baseline C,
AVX2+F16C, AVX-512), so the portable fallback is tested on the same machine as the SIMD paths.
Exact semantics are compared bit for bit; NaNs are compared as NaNs (payloads may differ).
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.kernel_reference import LENGTHS, OPS, WORLD, acc_dtype, assert_same, make_input, reference, widen
from reduction_server import _native
from reduction_server.wire.protocol import DType, ReduceOp


def test_best_isa_is_selected_by_default():
    assert _native.isa() == _native.available_isas()[-1]
    assert _native.available_isas()[0] == "baseline"
    with pytest.raises(ValueError, match="unknown ISA"):
        _native._select_isa("sse9")


# ------------------------------------------------------------------------------------------
# The dtype x op matrix


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_matrix(isa, dtype, op, n):
    rng = np.random.default_rng([int(dtype), int(op), n])
    inputs = [make_input(rng, dtype, op, n) for _ in range(4)]  # a load, then 3 accumulates
    want_acc, want_out = reference(inputs, dtype, op, WORLD)

    acc = np.full(n, 123, acc_dtype(dtype))  # garbage that load must overwrite
    _native.load(acc, inputs[0], int(dtype))
    assert_same(acc, widen(inputs[0], dtype))
    for x in inputs[1:]:
        _native.accumulate(acc, x, int(dtype), int(op))
    ties = op in (ReduceOp.MAX, ReduceOp.MIN)
    assert_same(acc, want_acc, signed_zero_ties=ties)

    out = np.full(n, 77, dtype.storage)
    _native.store(acc, out, int(dtype), int(op), WORLD)
    assert_same(out, want_out, bf16=dtype is DType.BFLOAT16, signed_zero_ties=ties)
    assert_same(acc, want_acc, signed_zero_ties=ties)  # store leaves a separate acc alone


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT64, DType.INT32, DType.UINT8], ids=lambda d: d.name)
def test_store_in_place(isa, dtype):
    rng = np.random.default_rng(int(dtype))
    inputs = [make_input(rng, dtype, ReduceOp.SUM, 1023) for _ in range(3)]
    want_acc, want_avg = reference(inputs, dtype, ReduceOp.AVG, WORLD)
    acc = inputs[0].copy()
    for x in inputs[1:]:
        _native.accumulate(acc, x, int(dtype), int(ReduceOp.AVG))
    for op in (ReduceOp.SUM, ReduceOp.MAX):  # nothing to do: acc stays as it is
        _native.store(acc, acc, int(dtype), int(op), WORLD)
        assert_same(acc, want_acc)
    _native.store(acc, acc, int(dtype), int(ReduceOp.AVG), WORLD)  # divides in place
    assert_same(acc, want_avg)
    # The same memory through two different objects counts as the same buffer too.
    acc2 = want_acc.copy()
    _native.store(acc2, memoryview(acc2).cast("B"), int(dtype), int(ReduceOp.AVG), WORLD)
    assert_same(acc2, want_avg)


def test_accumulate_into_itself(isa):
    acc = np.arange(1027, dtype=np.float32)
    _native.accumulate(acc, acc, DType.FLOAT32, ReduceOp.SUM)
    assert_same(acc, np.arange(1027, dtype=np.float32) * 2)


def test_enums_and_plain_ints_are_accepted():
    acc = np.zeros(4, np.float32)
    _native.load(acc, np.ones(4, np.float16), DType.FLOAT16)
    _native.accumulate(acc, np.ones(4, np.float16), DType.FLOAT16, ReduceOp.AVG)
    out = np.zeros(4, np.float16)
    _native.store(acc, out, np.int64(6), np.int32(4), np.int64(2))
    assert_same(out, np.ones(4, np.float16))


# ------------------------------------------------------------------------------------------
# Buffers


def test_any_buffer_object_by_dtype_code():
    src = np.array([1.5, -2.0, 3.25], np.float16)
    acc = bytearray(12)  # 3 x float32
    _native.load(acc, memoryview(src.tobytes()), DType.FLOAT16)  # read-only src is fine
    np.testing.assert_array_equal(np.frombuffer(acc, np.float32), [1.5, -2.0, 3.25])
    _native.accumulate(acc, src.view(np.uint8), DType.FLOAT16, ReduceOp.SUM)
    dst = np.zeros((3, 2), np.uint8)  # any shape and format: only the bytes count
    _native.store(memoryview(acc), dst, DType.FLOAT16, ReduceOp.SUM, 1)
    np.testing.assert_array_equal(dst.reshape(-1).view(np.float16), [3.0, -4.0, 6.5])
    acc2d = np.zeros((2, 3), np.int32)
    _native.load(acc2d, np.arange(6, dtype=np.int32).tobytes(), DType.INT32)
    np.testing.assert_array_equal(acc2d, np.arange(6).reshape(2, 3))


def test_empty_is_a_noop():
    for dtype in DType:
        acc = np.empty(0, acc_dtype(dtype))
        src = np.empty(0, dtype.storage)
        _native.load(acc, src, int(dtype))
        _native.accumulate(acc, src, int(dtype), int(ReduceOp.PROD))
        _native.store(acc, src, int(dtype), int(ReduceOp.AVG), WORLD)
    _native.load(bytearray(), b"", DType.FLOAT16)


# ------------------------------------------------------------------------------------------
# Errors


def test_size_mismatch_names_sizes_and_dtype():
    with pytest.raises(ValueError) as e:
        _native.load(np.zeros(3, np.float32), np.zeros(4, np.float16), DType.FLOAT16)
    msg = str(e.value)
    assert "12 bytes (3 x float32)" in msg and "8 bytes (4 x float16)" in msg
    with pytest.raises(ValueError, match=r"accumulator holds 16 bytes \(4 x int32\).*24 bytes \(6 x int32\)"):
        _native.accumulate(np.zeros(4, np.int32), np.zeros(6, np.int32), DType.INT32, ReduceOp.SUM)
    with pytest.raises(ValueError, match="13 bytes.*not a whole number of float32"):
        _native.accumulate(bytearray(13), np.zeros(4, np.float16), DType.BFLOAT16, ReduceOp.SUM)
    with pytest.raises(ValueError, match=r"destination holds 16 bytes \(8 x float16\).*16 bytes \(4 x float32\)"):
        _native.store(np.zeros(4, np.float32), np.zeros(8, np.float16), DType.FLOAT16, ReduceOp.SUM, 1)
    with pytest.raises(ValueError, match=r"destination holds 8 bytes.*\(1 x float64\).*2 x float64"):
        _native.store(np.zeros(2), np.zeros(1), DType.FLOAT64, ReduceOp.SUM, 1)


def test_partial_elements():
    with pytest.raises(ValueError, match="7 bytes, not a whole number of float16"):
        _native.load(np.zeros(4, np.float32), bytes(7), DType.FLOAT16)
    with pytest.raises(ValueError, match="10 bytes, not a whole number of int64"):
        _native.accumulate(bytearray(8), bytes(10), DType.INT64, ReduceOp.SUM)
    with pytest.raises(ValueError, match="6 bytes, not a whole number of float32"):
        _native.store(bytearray(6), bytearray(3), DType.FLOAT16, ReduceOp.SUM, 1)


@pytest.mark.parametrize("which", ["acc", "src", "dst"])
def test_non_contiguous(which):
    acc, src, dst = np.zeros(4, np.float32), np.zeros(4, np.float16), np.zeros(4, np.float16)
    strided = {
        "acc": np.zeros(8, np.float32)[::2],
        "src": np.zeros(8, np.float16)[::2],
        "dst": np.zeros(8, np.float16)[::2],
    }[which]
    role = {"acc": "accumulator", "src": "contribution", "dst": "destination"}[which]
    args = {"acc": acc, "src": src, "dst": dst}
    args[which] = strided
    with pytest.raises(ValueError, match=f"{role} must be C-contiguous"):
        if which == "dst":
            _native.store(args["acc"], args["dst"], DType.FLOAT16, ReduceOp.SUM, 1)
        else:
            _native.accumulate(args["acc"], args["src"], DType.FLOAT16, ReduceOp.SUM)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        _native.load(memoryview(bytearray(32))[::2], bytes(8), DType.FLOAT16)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        _native.load(np.zeros((4, 4), np.float32).T, np.zeros(16, np.float32), DType.FLOAT32)


def test_read_only():
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="accumulator must be writable"):
        _native.load(ro, np.zeros(4, np.float32), DType.FLOAT32)
    with pytest.raises(ValueError, match="accumulator must be writable"):
        _native.accumulate(bytes(16), np.zeros(4, np.float32), DType.FLOAT32, ReduceOp.SUM)
    with pytest.raises(ValueError, match="destination must be writable"):
        _native.store(np.zeros(4, np.float32), bytes(8), DType.FLOAT16, ReduceOp.SUM, 1)
    with pytest.raises(ValueError, match="destination must be writable"):
        _native.store(ro, ro, DType.FLOAT32, ReduceOp.AVG, 2)
    _native.store(ro, np.zeros(4, np.float32), DType.FLOAT32, ReduceOp.AVG, 2)  # acc is only read


def test_not_a_buffer():
    with pytest.raises(TypeError, match="buffer protocol"):
        _native.load(np.zeros(4, np.float32), [1.0, 2.0], DType.FLOAT32)
    with pytest.raises(TypeError, match="buffer protocol"):
        _native.store(np.zeros(4, np.float32), None, DType.FLOAT32, ReduceOp.SUM, 1)


@pytest.mark.parametrize("code", [10, -1, 64, 255, 2**70])
def test_bad_dtype_code(code):
    buf = np.zeros(8, np.float64)
    with pytest.raises(ValueError, match=f"unknown dtype code {code}"):
        _native.load(buf, buf.copy(), code)
    with pytest.raises(ValueError, match=f"unknown dtype code {code}"):
        _native.accumulate(buf, buf.copy(), code, ReduceOp.SUM)
    with pytest.raises(ValueError, match=f"unknown dtype code {code}"):
        _native.store(buf, buf.copy(), code, ReduceOp.SUM, 1)
    with pytest.raises(ValueError, match="dtype code must be an integer"):
        _native.load(buf, buf.copy(), "float32")


@pytest.mark.parametrize("code", [5, -1, int(ReduceOp.BROADCAST), 2**70])
def test_bad_op_code(code):
    buf = np.zeros(8, np.float64)
    with pytest.raises(ValueError, match=f"unknown reduction op code {code}"):
        _native.accumulate(buf, buf.copy(), DType.FLOAT64, code)
    with pytest.raises(ValueError, match=f"unknown reduction op code {code}"):
        _native.store(buf, buf.copy(), DType.FLOAT64, code, 1)
    with pytest.raises(ValueError, match="op code must be an integer"):
        _native.accumulate(buf, buf.copy(), DType.FLOAT64, 1.0)


@pytest.mark.parametrize("world", [0, -3, "3", 2.0])
def test_bad_world_for_avg(world):
    buf = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="world must be a positive integer"):
        _native.store(buf, buf, DType.FLOAT32, ReduceOp.AVG, world)


def test_overlap_that_is_not_aliasing():
    buf = np.zeros(16, np.float32)
    with pytest.raises(ValueError, match="overlap"):  # float16 store needs its own buffer
        _native.store(buf, buf.view(np.uint8)[:32], DType.FLOAT16, ReduceOp.SUM, 1)
    with pytest.raises(ValueError, match="overlap"):
        _native.accumulate(buf[:8], buf[4:12], DType.FLOAT32, ReduceOp.SUM)
    with pytest.raises(ValueError, match="overlap"):
        _native.load(buf[:8], buf.view(np.uint16)[:8], DType.BFLOAT16)
    np.testing.assert_array_equal(buf, 0)


# ------------------------------------------------------------------------------------------
# accumulate_copies: the last fold of a round whose result goes to several slots


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_accumulate_copies_is_accumulate_then_a_store_into_each_out(isa, dtype, op):
    """Lengths within one 64 KiB block and across several with a tail; one out is the
    contribution itself (the last rank's own slot), read before it is written. Each out is what
    store() gives from the whole sum, bit for bit; the accumulator ends as the result where the
    dtype accumulates in itself (an average divided), as the float32 sum for 16-bit floats."""
    self_accumulating = acc_dtype(dtype) == dtype.storage
    ties = op in (ReduceOp.MAX, ReduceOp.MIN)
    for n in (1, 1023, 3 * (65536 // np.dtype(acc_dtype(dtype)).itemsize) + 5):
        rng = np.random.default_rng([int(dtype), int(op), n])
        first, src = (make_input(rng, dtype, op, n) for _ in range(2))
        acc = np.empty(n, acc_dtype(dtype))
        _native.load(acc, first, int(dtype))
        want_acc = acc.copy()
        _native.accumulate(want_acc, src, int(dtype), int(op))
        want = np.empty(n, dtype.storage)
        _native.store(want_acc, want, int(dtype), int(op), WORLD)
        src0 = src.copy()
        outs = [np.full(n, 9, dtype.storage), np.full(n, 8, dtype.storage)]
        # the contribution's own slot first on odd lengths (a 16-bit block is rounded into it), last on even
        order = (
            [memoryview(src), outs[0], memoryview(outs[1])]
            if n % 2
            else [outs[0], memoryview(outs[1]), memoryview(src)]
        )
        _native.accumulate_copies(acc, src, int(dtype), int(op), WORLD, order)
        for got in (*outs, src):
            assert_same(got, want, bf16=dtype is DType.BFLOAT16, signed_zero_ties=ties)
        assert_same(
            acc,
            want if self_accumulating else want_acc,
            bf16=dtype is DType.BFLOAT16 and self_accumulating,
            signed_zero_ties=ties,
        )
        if not self_accumulating:  # no outs: acc ends as the float32 sum
            acc = np.empty(n, acc_dtype(dtype))
            _native.load(acc, first, int(dtype))
            _native.accumulate_copies(acc, src0, int(dtype), int(op), WORLD, [])
            assert_same(acc, want_acc, signed_zero_ties=ties)


def test_accumulate_copies_refuses_what_it_cannot_do_and_writes_nothing():
    acc, src = np.ones(64, np.float32), np.full(64, 2.0, np.float32)
    out = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="copy destination 0 holds 256 bytes, the contribution 128"):
        _native.accumulate_copies(
            np.zeros(64, np.float32),
            np.zeros(64, np.float16),
            DType.FLOAT16,
            ReduceOp.SUM,
            1,
            [np.zeros(64, np.float32)],
        )  # a 16-bit result's size
    with pytest.raises(ValueError, match="copy destination 0 holds 128 bytes, the contribution 256"):
        _native.accumulate_copies(acc, src, DType.FLOAT32, ReduceOp.SUM, 1, [np.zeros(32, np.float32)])
    with pytest.raises(ValueError, match="a copy's destination and the accumulator overlap"):
        _native.accumulate_copies(acc, src, DType.FLOAT32, ReduceOp.SUM, 1, [acc])
    with pytest.raises(ValueError, match="two copies' destinations overlap"):
        _native.accumulate_copies(acc, src, DType.FLOAT32, ReduceOp.SUM, 1, [out, out])
    both = np.zeros(96, np.float32)
    with pytest.raises(ValueError, match="a copy's destination and the contribution overlap"):
        _native.accumulate_copies(acc, both[:64], DType.FLOAT32, ReduceOp.SUM, 1, [both[32:]])
    with pytest.raises(ValueError, match="copy's destination must be writable"):
        _native.accumulate_copies(acc, src, DType.FLOAT32, ReduceOp.SUM, 1, [bytes(256)])
    with pytest.raises(ValueError, match="world must be a positive integer to average over"):
        _native.accumulate_copies(acc, src, DType.FLOAT32, ReduceOp.AVG, 0, [out])
    with pytest.raises(TypeError, match="must support the buffer protocol"):
        _native.accumulate_copies(acc, src, DType.FLOAT32, ReduceOp.SUM, 1, [object()])
    np.testing.assert_array_equal(acc, 1.0)  # refused before anything was summed
    np.testing.assert_array_equal(out, 0.0)
