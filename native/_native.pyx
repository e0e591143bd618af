# cython: language_level=3, boundscheck=False, wraparound=False
"""Native reduction kernels of the reducer's hot path (built as reduction_server._native).

    load(acc, src, dtype)                    acc[:] = widen(src)
    accumulate(acc, src, dtype, op)          acc[:] = op(acc, widen(src)); AVG accumulates like SUM
    accumulate_copies(acc, src, dtype, op, world, outs)   the last accumulate, and each of outs
                                             stored from it, block by block while in cache
    store(acc, dst, dtype, op, world)        dst[:] = narrow(acc), divided by world first for AVG
    load_int8(acc, src, block)               acc[:] = decode(src): float32 from int8 blocks
    accumulate_int8(acc, src, block)         acc[:] += decode(src)
    store_int8(acc, dst, block)              dst[:] = encode(acc): float32 to int8 blocks
    store_release(buf, offset, value)        a uint64 counter in shared memory, written after
    load_acquire(buf, offset)                every access before it; read before every one after

`dtype` is the wire dtype of src/dst (reduction_server.wire.protocol.DType, NCCL numbering) and `op`
a reduction op (ReduceOp, NCCL numbering). The accumulator is float32 for FLOAT16 and BFLOAT16
and the dtype itself otherwise. acc, src and dst are any C-contiguous objects that export the
buffer protocol; their bytes are read as `dtype` (or the accumulator type) whatever their own
format says (bfloat16 travels as uint16 bits). acc/dst and src must be the very same memory or
not overlap at all. The GIL is released while a kernel runs. The C kernels are in kernels.h.
"""
from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FULL_RO, PyBUF_WRITABLE,
                             PyBuffer_IsContiguous, PyBuffer_Release, PyObject_CheckBuffer,
                             PyObject_GetBuffer)
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

import operator


cdef extern from "kernels.h" nogil:
    enum:
        RS_NDTYPES
        RS_NOPS
        RS_NISAS
        RS_AVG
        RS_FLOAT16
        RS_BFLOAT16
    const char *rs_dtype_names[]
    const char *rs_op_names[]
    const char *rs_isa_names[]
    const size_t rs_itemsizes[]
    const size_t rs_acc_itemsizes[]
    int rs_isa_ok[]
    int rs_best_isa
    int rs_active_isa
    void rs_init()
    int rs_select_isa(int isa)
    int rs_load(int dtype, void *acc, const void *src, size_t n)
    int rs_accumulate(int dtype, int op, void *acc, const void *src, size_t n)
    int rs_store(int dtype, int op, const void *acc, void *dst, size_t n, int64_t world)
    void rs_i8b_load(float *acc, const void *src, size_t n, size_t block)
    void rs_i8b_accumulate(float *acc, const void *src, size_t n, size_t block)
    void rs_i8b_store(const float *acc, void *dst, size_t n, size_t block)

cdef extern from *:
    """
    static inline void rs_store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline uint64_t rs_load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    """
    void rs_store_release(uint64_t *p, uint64_t v) nogil
    uint64_t rs_load_acquire(const uint64_t *p) nogil

rs_init()

DTYPE_NAMES = tuple(rs_dtype_names[i].decode() for i in range(RS_NDTYPES))
OP_NAMES = tuple(rs_op_names[i].decode() for i in range(RS_NOPS))


# --------------------------------------------------------------------------------------------
# Argument checking. Only the error paths build strings; the happy path is a few C compares.

cdef int _dtype_code(object dtype) except -1:
    cdef object code
    try:
        code = operator.index(dtype)
    except TypeError:
        raise ValueError(f"dtype code must be an integer, not {dtype!r}") from None
    if not 0 <= code < RS_NDTYPES:
        raise ValueError(f"unknown dtype code {code}; expected 0..{RS_NDTYPES - 1} "
                         f"({', '.join(f'{i}={n}' for i, n in enumerate(DTYPE_NAMES))})")
    return code


cdef int _op_code(object op) except -1:
    cdef object code
    try:
        code = operator.index(op)
    except TypeError:
        raise ValueError(f"reduction op code must be an integer, not {op!r}") from None
    if not 0 <= code < RS_NOPS:
        raise ValueError(f"unknown reduction op code {code}; expected 0..{RS_NOPS - 1} "
                         f"({', '.join(f'{i}={n}' for i, n in enumerate(OP_NAMES))})")
    return code


cdef int64_t _world(object world) except -1:
    """The number of ranks an AVG divides by, checked."""
    try:
        w = operator.index(world)
    except TypeError:
        raise ValueError(f"world must be a positive integer, not {world!r}") from None
    if not 1 <= w <= 0x7fffffffffffffff:
        raise ValueError(f"world must be a positive integer to average over, not {world!r}")
    return w


cdef int _get(object obj, Py_buffer *view, bint writable, str role) except -1:
    """PyObject_GetBuffer with clear errors; on success the caller must release `view`."""
    cdef int flags = PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    cdef Py_buffer probe
    try:
        PyObject_GetBuffer(obj, view, flags)
        return 0
    except (BufferError, ValueError, TypeError) as exc:
        error = exc
    # Exporters disagree on the exception (numpy: ValueError, memoryview: BufferError); find
    # out what was wrong with a permissive request and say it plainly.
    if not PyObject_CheckBuffer(obj):
        raise TypeError(f"the {role} must support the buffer protocol "
                        f"(bytearray, memoryview, numpy array, ...), not {type(obj).__name__}")
    try:
        PyObject_GetBuffer(obj, &probe, PyBUF_FULL_RO)
    except Exception:
        raise error  # the exporter's own complaint: nothing clearer to say
    try:
        if not PyBuffer_IsContiguous(&probe, b'C'):
            raise ValueError(f"the {role} must be C-contiguous (got a strided "
                             f"{type(obj).__name__}; pass a contiguous copy)") from error
        if writable and probe.readonly:
            raise ValueError(f"the {role} must be writable (got a read-only "
                             f"{type(obj).__name__})") from error
    finally:
        PyBuffer_Release(&probe)
    raise error  # refused for another reason: pass the exporter's error on


cdef str _count(Py_ssize_t nbytes, size_t itemsize, const char *name):
    if nbytes % <Py_ssize_t>itemsize:
        return f"not a whole number of {name.decode()} elements"
    return f"{nbytes // <Py_ssize_t>itemsize} x {name.decode()}"


cdef inline const char *_acc_name(int dtype):
    return rs_dtype_names[7] if dtype == RS_FLOAT16 or dtype == RS_BFLOAT16 else rs_dtype_names[dtype]


cdef int _check_overlap(Py_buffer *a, Py_buffer *b, str what, bint same_ok=True) except -1:
    """Raise unless a and b are apart, or (same_ok) the very same memory."""
    cdef uintptr_t a0 = <uintptr_t>a.buf, b0 = <uintptr_t>b.buf
    cdef uintptr_t a1 = a0 + <uintptr_t>a.len, b1 = b0 + <uintptr_t>b.len
    if a.len == 0 or b.len == 0 or a1 <= b0 or b1 <= a0:
        return 0
    if same_ok and a0 == b0 and a.len == b.len:
        return 0
    raise ValueError(f"{what} overlap{' without being the same memory' if same_ok else ''}; pass separate buffers")


# --------------------------------------------------------------------------------------------
# The API

cdef int _fold(object acc, object src, object dtype, object op, bint first, object world=None,
               object outs=None) except -1:
    cdef int d = _dtype_code(dtype)
    cdef int o = 0 if first else _op_code(op)
    cdef int64_t w = _world(world) if outs is not None and o == RS_AVG else 1
    cdef size_t isz = rs_itemsizes[d], asz = rs_acc_itemsizes[d]
    cdef Py_buffer a, s
    cdef size_t n
    cdef int rc
    _get(src, &s, False, "contribution")
    try:
        if s.len % <Py_ssize_t>isz:
            raise ValueError(f"the contribution holds {s.len} bytes, not a whole number of "
                             f"{rs_dtype_names[d].decode()} elements ({isz} bytes each)")
        n = <size_t>s.len // isz
        _get(acc, &a, True, "accumulator")
        try:
            if <size_t>a.len != n * asz:
                raise ValueError(
                    f"accumulator holds {a.len} bytes ({_count(a.len, asz, _acc_name(d))}) "
                    f"but the contribution holds {s.len} bytes ({n} x "
                    f"{rs_dtype_names[d].decode()}); the accumulator must hold {n * asz} bytes")
            _check_overlap(&a, &s, "the accumulator and the contribution")
            if outs is not None:
                rc = _fold_copies(&a, &s, d, o, w, n, outs)
            else:
                with nogil:
                    if first:
                        rc = rs_load(d, a.buf, s.buf, n)
                    else:
                        rc = rs_accumulate(d, o, a.buf, s.buf, n)
            if rc:
                raise SystemError("reduction kernel rejected its arguments")
        finally:
            PyBuffer_Release(&a)
    finally:
        PyBuffer_Release(&s)
    return 0


def load(acc, src, dtype):
    """acc[:] = widen(src): start an accumulator from a first contribution of `dtype`."""
    _fold(acc, src, dtype, None, True)


def accumulate(acc, src, dtype, op):
    """acc[:] = op(acc, widen(src)) elementwise; AVG accumulates like SUM."""
    _fold(acc, src, dtype, op, False)


# Bytes of a block that accumulate_copies sums and then copies while it is still in cache: the
# copies read the sum from cache, not memory.
cdef enum:
    _COPY_BLOCK = 64 * 1024


def accumulate_copies(acc, src, dtype, op, world, outs):
    """The last contribution of a round whose result goes to several places (shared-memory
    slots): acc[:] = op(acc, widen(src)) as accumulate() does, and each of `outs` gets the
    result as store(acc, out, dtype, op, world) gives it, a block at a time while the block is in
    cache. A dtype that accumulates in itself is divided in acc (AVG) and copied from there;
    FLOAT16 and BFLOAT16 are stored into the first out (acc stays the float32 sum) and copied
    from it. Each out holds len(src) bytes, does not overlap acc or another out, and may be src
    itself (a block of src is read before it is written)."""
    _fold(acc, src, dtype, op, False, world, outs)


cdef int _fold_copies(Py_buffer *a, Py_buffer *s, int d, int o, int64_t w, size_t n, object outs) except -1:
    """accumulate_copies' loop over blocks, once acc and src are checked; raises for an out that
    is not a buffer of src's size apart from the others, or a kernel that refused (no block it
    did not finish is copied)."""
    cdef size_t isz = rs_itemsizes[d], asz = rs_acc_itemsizes[d], off, m, block = _COPY_BLOCK // asz
    cdef bint narrow = asz != isz
    cdef char *first
    cdef Py_ssize_t k = len(outs), i, j, got = 0
    cdef Py_buffer *views = <Py_buffer *>malloc(max(k, 1) * sizeof(Py_buffer))
    cdef char **dst = <char **>malloc(max(k, 1) * sizeof(char *))
    cdef int rc = 0
    if views == NULL or dst == NULL:
        free(views)
        free(dst)
        raise MemoryError()
    try:
        for i in range(k):
            _get(outs[i], &views[i], True, "copy's destination")
            got += 1
            if views[i].len != s.len:
                raise ValueError(f"copy destination {i} holds {views[i].len} bytes, the contribution {s.len}")
            _check_overlap(&views[i], a, "a copy's destination and the accumulator", False)
            for j in range(i):
                _check_overlap(&views[i], &views[j], "two copies' destinations", False)
            _check_overlap(&views[i], s, "a copy's destination and the contribution")  # it may be src itself
            dst[i] = <char *>views[i].buf
        with nogil:
            off = 0
            while off < n and rc == 0:
                m = block if n - off > block else n - off
                rc = rs_accumulate(d, o, <char *>a.buf + off * asz, <const char *>s.buf + off * isz, m)
                if rc == 0 and narrow:  # the first out gets the rounded block, the others a copy of it
                    if k > 0:
                        first = dst[0] + off * isz
                        rc = rs_store(d, o, <char *>a.buf + off * asz, first, m, w)
                elif rc == 0:
                    first = <char *>a.buf + off * isz
                    if o == RS_AVG:
                        rc = rs_store(d, o, first, first, m, w)
                if rc:
                    break
                for i in range(1 if narrow else 0, k):
                    memcpy(dst[i] + off * isz, first, m * isz)
                off += m
    finally:
        for i in range(got):
            PyBuffer_Release(&views[i])
        free(views)
        free(dst)
    if rc:
        raise SystemError("reduction kernel rejected its arguments")
    return 0


def store(acc, dst, dtype, op, world):
    """dst[:] = narrow(acc), divided by `world` first (in the accumulator type) when op is AVG.

    For dtypes that need no narrowing (all but FLOAT16 and BFLOAT16) dst may be acc itself:
    then only the AVG division happens, in place.
    """
    cdef int d = _dtype_code(dtype)
    cdef int o = _op_code(op)
    cdef int64_t w = _world(world) if o == RS_AVG else 1
    cdef size_t isz = rs_itemsizes[d], asz = rs_acc_itemsizes[d]
    cdef Py_buffer a, t
    cdef size_t n
    cdef int rc
    _get(acc, &a, False, "accumulator")
    try:
        if a.len % <Py_ssize_t>asz:
            raise ValueError(f"the accumulator holds {a.len} bytes, not a whole number of "
                             f"{_acc_name(d).decode()} elements ({asz} bytes each)")
        n = <size_t>a.len // asz
        _get(dst, &t, True, "destination")
        try:
            if <size_t>t.len != n * isz:
                raise ValueError(
                    f"destination holds {t.len} bytes ({_count(t.len, isz, rs_dtype_names[d])}) "
                    f"but the accumulator holds {a.len} bytes ({n} x "
                    f"{_acc_name(d).decode()}); the destination must hold {n * isz} bytes")
            _check_overlap(&a, &t, "the accumulator and the destination")
            with nogil:
                rc = rs_store(d, o, a.buf, t.buf, n, w)
            if rc:
                raise SystemError("reduction kernel rejected its arguments")
        finally:
            PyBuffer_Release(&t)
    finally:
        PyBuffer_Release(&a)


# --------------------------------------------------------------------------------------------
# Block-scaled int8 (reduction_server/wire/formats.py, docs/protocol.md "Formats"): n float32
# elements as blocks of `block`, each a float32 scale and its int8 values, the last block shorter.

cdef int _int8_blocks(object acc, object blocks, object block, int kind) except -1:
    """kind 0: acc = decode(blocks); 1: acc += decode(blocks); 2: blocks = encode(acc)."""
    cdef Py_ssize_t b
    try:
        b = operator.index(block)
    except TypeError:
        raise ValueError(f"block must be an integer, not {block!r}") from None
    if b < 1:
        raise ValueError(f"block must be at least 1, not {b}")
    cdef Py_buffer a, s
    cdef size_t n
    _get(acc, &a, kind != 2, "accumulator" if kind != 2 else "float32 source")
    try:
        if a.len % 4:
            raise ValueError(f"the float32 buffer holds {a.len} bytes, not a whole number of float32 elements")
        n = <size_t>a.len // 4
        _get(blocks, &s, kind == 2, "int8 blocks")
        try:
            expected = n + 4 * ((n + b - 1) // b)
            if s.len != expected:
                raise ValueError(f"the int8 blocks hold {s.len} bytes but {n} elements in blocks of {b} "
                                 f"take {expected}")
            _check_overlap(&a, &s, "the float32 buffer and the int8 blocks", False)
            with nogil:
                if kind == 0:
                    rs_i8b_load(<float *>a.buf, s.buf, n, <size_t>b)
                elif kind == 1:
                    rs_i8b_accumulate(<float *>a.buf, s.buf, n, <size_t>b)
                else:
                    rs_i8b_store(<const float *>a.buf, s.buf, n, <size_t>b)
        finally:
            PyBuffer_Release(&s)
    finally:
        PyBuffer_Release(&a)
    return 0


def load_int8(acc, src, block):
    """acc[:] = decode(src): each element its block's scale times its int8 value, in float32."""
    _int8_blocks(acc, src, block, 0)


def accumulate_int8(acc, src, block):
    """acc[:] += decode(src), in float32 (the product rounded, then the sum)."""
    _int8_blocks(acc, src, block, 1)


def store_int8(acc, dst, block):
    """dst[:] = encode(acc): per block scale = absmax / 127, values nearest-even of x * 127 / absmax;
    a block with a NaN or an infinity gets a NaN scale (it decodes as NaN), one whose absmax is
    below 2^-96 a zero scale."""
    _int8_blocks(acc, dst, block, 2)


# --------------------------------------------------------------------------------------------
# Counters that two processes share (a result slot released, shared_memory.py): the copy out of a
# slot must be complete before another process sees the counter that lets the slot be written.

cdef uint64_t *_counter(Py_buffer *v, object offset) except NULL:
    cdef Py_ssize_t at = offset
    if at < 0 or at % 8 or at + 8 > v.len or (<uintptr_t>v.buf + <uintptr_t>at) % 8:
        raise ValueError(f"a counter at byte {at} of a buffer of {v.len} bytes is out of range or not 8-byte aligned")
    return <uint64_t *>(<char *>v.buf + at)


def store_release(buf, offset, value):
    """Write the uint64 at byte `offset` of buf after every memory access this thread made before it."""
    cdef Py_buffer v
    cdef uint64_t x = value
    _get(buf, &v, True, "counter's buffer")
    try:
        rs_store_release(_counter(&v, offset), x)
    finally:
        PyBuffer_Release(&v)


def load_acquire(buf, offset):
    """The uint64 at byte `offset` of buf, read before every memory access this thread makes after it."""
    cdef Py_buffer v
    _get(buf, &v, False, "counter's buffer")
    try:
        return rs_load_acquire(_counter(&v, offset))
    finally:
        PyBuffer_Release(&v)


# --------------------------------------------------------------------------------------------
# Introspection, for tests and benchmarks

def isa():
    """The instruction-set level the kernels run with now: 'baseline', 'avx2' or 'avx512'."""
    return rs_isa_names[rs_active_isa].decode()


def available_isas():
    """The levels this CPU and build can run, lowest first."""
    return tuple(rs_isa_names[i].decode() for i in range(RS_NISAS) if rs_isa_ok[i])


def _select_isa(name=None):
    """Force a level by name (None: the best one). For tests and benchmarks only: not safe
    while kernels run on other threads. Returns the previous level's name."""
    cdef int i
    previous = isa()
    if name is None:
        i = rs_best_isa
    else:
        names = [rs_isa_names[k].decode() for k in range(RS_NISAS)]
        if name not in names:
            raise ValueError(f"unknown ISA level {name!r}; expected one of {names}")
        i = names.index(name)
    if rs_select_isa(i):
        raise ValueError(f"ISA level {name!r} is not available here; "
                         f"available: {', '.join(available_isas())}")
    return previous
