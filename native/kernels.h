/*
 * kernels.h - the element-wise reduction kernels of the reducer's hot path.
 *
 * Three entry points, used by native/_native.pyx (which validates every argument first):
 *
 *   rs_load(dtype, acc, src, n)              acc[i] = widen(src[i])
 *   rs_accumulate(dtype, op, acc, src, n)    acc[i] = op(acc[i], widen(src[i]))
 *   rs_store(dtype, op, acc, dst, n, world)  dst[i] = narrow(acc[i])   (acc[i] / world for AVG)
 *
 * dtype and op use NCCL's numbering (reduction_server/wire/protocol.py). The accumulator is float32
 * for FLOAT16 and BFLOAT16 and the wire type itself for every other dtype.
 *
 * Semantics (these match NumPy; tests/test_kernels.py checks them bit for bit):
 *   - integers wrap on overflow (the arithmetic is done in the unsigned type of the same width);
 *     AVG of integers is the wrapped sum divided by world, truncating toward zero (C division);
 *   - float MAX/MIN propagate NaN like np.maximum/np.minimum;
 *   - float AVG divides by world once, in the accumulator type, at store;
 *   - float16 <-> float32 as IEEE conversions, round to nearest even (like F16C and numpy);
 *   - bfloat16 widens as bits << 16 and narrows rounding to nearest even; a NaN stays a (quiet)
 *     NaN.
 *
 * Portability: the extension is built without -march=native. Every kernel is instantiated for
 * a portable "baseline" (plain C loops, vectorised by gcc -O3 for the compile target, e.g.
 * SSE2 on x86-64) and, on x86-64, for AVX2+F16C and for AVX-512 (F/BW/VL) through
 * __attribute__((target(...))). The 16-bit conversions and the integer AVG division use
 * intrinsics in those two levels and portable C in the baseline. rs_init() picks the best level the CPU (and OS)
 * supports with __builtin_cpu_supports; rs_select_isa() can force a lower one (for tests).
 *
 * Buffers: acc and src (or acc and dst) are either the very same memory or do not overlap at
 * all; the caller checks this.
 */
#ifndef REDUCTION_SERVER_KERNELS_H
#define REDUCTION_SERVER_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* RS_NO_X86_SIMD: build only the portable kernels (what non-x86 targets get). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(RS_NO_X86_SIMD)
#define RS_X86 1
#include <immintrin.h>
#else
#define RS_X86 0
#endif

/* ---------------------------------------------------------------------------------------- */
/* Codes (NCCL numbering, see reduction_server/wire/protocol.py)                                    */

enum {
    RS_INT8 = 0, RS_UINT8 = 1, RS_INT32 = 2, RS_UINT32 = 3, RS_INT64 = 4, RS_UINT64 = 5,
    RS_FLOAT16 = 6, RS_FLOAT32 = 7, RS_FLOAT64 = 8, RS_BFLOAT16 = 9, RS_NDTYPES = 10
};
enum { RS_SUM = 0, RS_PROD = 1, RS_MAX = 2, RS_MIN = 3, RS_AVG = 4, RS_NOPS = 5 };
#define RS_OPCODE_sum RS_SUM
#define RS_OPCODE_prod RS_PROD
#define RS_OPCODE_max RS_MAX
#define RS_OPCODE_min RS_MIN
enum { RS_ISA_BASELINE = 0, RS_ISA_AVX2 = 1, RS_ISA_AVX512 = 2, RS_NISAS = 3 };

static const char *const rs_dtype_names[RS_NDTYPES] = {
    "int8", "uint8", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "bfloat16"};
static const char *const rs_op_names[RS_NOPS] = {"sum", "prod", "max", "min", "avg"};
static const char *const rs_isa_names[RS_NISAS] = {"baseline", "avx2", "avx512"};
static const size_t rs_itemsizes[RS_NDTYPES] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
/* Bytes per element of the accumulator: float32 for the 16-bit floats. */
static const size_t rs_acc_itemsizes[RS_NDTYPES] = {1, 1, 4, 4, 8, 8, 4, 4, 8, 4};

/* ---------------------------------------------------------------------------------------- */
/* Scalar 16-bit conversions (portable; the SIMD paths use them for loop tails, and they are  */
/* written to give the very same bits as the F16C instructions).                              */

static inline float rs_bits_f32(uint32_t x) { float f; memcpy(&f, &x, 4); return f; }
static inline uint32_t rs_f32_bits(float f) { uint32_t x; memcpy(&x, &f, 4); return x; }

/* float16 -> float32: exact. NaNs are quieted (as VCVTPH2PS does), payload kept. */
static inline float rs_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) /* inf, NaN */
        return rs_bits_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0));
    if (exp == 0) /* zero, subnormal: man * 2^-24, exact in float32 */
        return rs_bits_f32(sign | rs_f32_bits((float)man * 0x1p-24f));
    return rs_bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* float32 -> float16, round to nearest even; overflow -> inf; NaN -> quiet NaN (top payload
 * bits kept, as VCVTPS2PH does). */
static inline uint16_t rs_f32_to_f16(float f)
{
    uint32_t x = rs_f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) /* >= 65520 (halfway from the largest half to 2^16) and inf */
        return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) { /* normal half: rebias, round the 13 dropped bits to even */
        uint32_t r = ax + 0x0fffu + ((ax >> 13) & 1u);
        return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
    }
    if (ax < 0x33000000u) /* below 2^-25 (2^-25 itself ties to zero): signed zero */
        return (uint16_t)sign;
    { /* subnormal half: round (1.m * 2^(e-127)) / 2^-24 to an integer, ties to even */
        uint32_t shift = 126u - (ax >> 23); /* 14..24 */
        uint32_t man = (ax & 0x7fffffu) | 0x800000u;
        uint32_t q = man >> shift, rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
        q += (rem > half) | ((rem == half) & q);
        return (uint16_t)(sign | q); /* q == 0x400 is the smallest normal, as it should be */
    }
}

/* bfloat16 -> float32: the top half of the float32's bits. */
static inline float rs_bf16_to_f32(uint16_t b) { return rs_bits_f32((uint32_t)b << 16); }

/* float32 -> bfloat16, round to nearest even; NaN -> the same NaN with its quiet bit set. */
static inline uint16_t rs_f32_to_bf16(float f)
{
    uint32_t x = rs_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x | 0x00400000u) >> 16);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* ---------------------------------------------------------------------------------------- */
/* Element operations. T: element type; U: unsigned type of the same width (integers wrap   */
/* by computing in U; uint8 * uint8 promotes to int and cannot overflow).                     */

#define RS_OP_sum_INT(T, U, a, b) ((T)((U)(a) + (U)(b)))
#define RS_OP_prod_INT(T, U, a, b) ((T)((U)(a) * (U)(b)))
#define RS_OP_max_INT(T, U, a, b) ((a) > (b) ? (a) : (b))
#define RS_OP_min_INT(T, U, a, b) ((a) < (b) ? (a) : (b))
#define RS_OP_sum_FLT(T, U, a, b) ((a) + (b))
#define RS_OP_prod_FLT(T, U, a, b) ((a) * (b))
/* NaN-propagating: a NaN in a is kept; a NaN in b fails the comparison and b is taken. */
#define RS_OP_max_FLT(T, U, a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define RS_OP_min_FLT(T, U, a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))

/* The dtypes whose accumulator is the dtype itself:
 *   X(..., CODE, name, T, U, KIND); RS_DEF_AVG_<name> defines the AVG store. */
#define RS_SAME_TYPES(X, ...)                                                  \
    X(__VA_ARGS__, RS_INT8, i8, int8_t, uint8_t, INT)                          \
    X(__VA_ARGS__, RS_UINT8, u8, uint8_t, uint8_t, INT)                        \
    X(__VA_ARGS__, RS_INT32, i32, int32_t, uint32_t, INT)                      \
    X(__VA_ARGS__, RS_UINT32, u32, uint32_t, uint32_t, INT)                    \
    X(__VA_ARGS__, RS_INT64, i64, int64_t, uint64_t, INT)                      \
    X(__VA_ARGS__, RS_UINT64, u64, uint64_t, uint64_t, INT)                    \
    X(__VA_ARGS__, RS_FLOAT32, f32, float, float, FLT)                         \
    X(__VA_ARGS__, RS_FLOAT64, f64, double, double, FLT)

/* The 16-bit floats, accumulated in float32: X(..., CODE, name) */
#define RS_HALF_TYPES(X, ...) X(__VA_ARGS__, RS_FLOAT16, f16) X(__VA_ARGS__, RS_BFLOAT16, bf16)

/* The accumulating ops (AVG accumulates like SUM). */
#define RS_ACC_OPS(X, ...) X(__VA_ARGS__, sum) X(__VA_ARGS__, prod) X(__VA_ARGS__, max) X(__VA_ARGS__, min)

/* ---------------------------------------------------------------------------------------- */
/* Per-ISA function attributes                                                               */

#define RS_ATTR_baseline
#if RS_X86
#define RS_ATTR_avx2 __attribute__((target("avx2,f16c")))
#define RS_ATTR_avx512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))
#endif

typedef void (*rs_acc_fn)(void *acc, const void *src, size_t n);
typedef void (*rs_store_fn)(const void *acc, void *dst, size_t n, int64_t world);
typedef void (*rs_i8b_fn)(float *acc, const unsigned char *src, size_t n, size_t block);
typedef void (*rs_i8b_store_fn)(const float *acc, unsigned char *dst, size_t n, size_t block);

typedef struct {
    rs_acc_fn load[RS_NDTYPES];           /* NULL: a plain copy */
    rs_acc_fn acc[RS_NDTYPES][RS_NOPS];
    rs_store_fn store[RS_NDTYPES];        /* NULL: a plain copy */
    rs_store_fn store_avg[RS_NDTYPES];
    rs_i8b_fn i8b_load, i8b_acc;          /* int8 blocks: decode into, decode and add to float32 */
    rs_i8b_store_fn i8b_store;            /* float32 -> int8 blocks */
} rs_table;

/* ---------------------------------------------------------------------------------------- */
/* Same-type kernels: plain loops that gcc vectorises for each ISA's target.                  */

#define RS_DEF_SAME_ACC(ISA, CODE, name, T, U, KIND, op)                                        \
    static RS_ATTR_##ISA void rs_acc_##name##_##op##_##ISA(void *acc_, const void *src_, size_t n) \
    {                                                                                           \
        T *acc = (T *)acc_;                                                                     \
        const T *src = (const T *)src_;                                                         \
        for (size_t i = 0; i < n; i++) {                                                        \
            T a = acc[i], b = src[i];                                                           \
            acc[i] = RS_OP_##op##_##KIND(T, U, a, b);                                           \
        }                                                                                       \
    }

/* AVG at store: dst[i] = acc[i] / world, rounded for floats, truncated toward zero for integers.
 *
 * Floats divide in their own type. Integers divide by a multiply-high with a precomputed
 * reciprocal (Granlund & Montgomery, "Division by invariant integers using multiplication",
 * PLDI 1994, fig. 4.1), exact for every L-bit n and 1 <= d < 2^L: the hardware divider is not
 * vectorised and costs 10-40 cycles per element. The integers are computed in L-bit lanes (16
 * for the 8-bit dtypes, which have no 8-bit multiply, else their own width); signed values
 * divide their magnitude, as C's truncating division does; a world above the largest
 * magnitude gives 0 everywhere. The baseline is plain C (64 bits through a 128-bit product);
 * AVX2 and AVX-512 use the vector helpers defined with their ISA below, and C division for the
 * few elements of a loop tail. */
#define RS_DEF_AVG_FLT(ISA, name, T)                                                             \
    static RS_ATTR_##ISA void rs_avg_##name##_##ISA(const void *acc_, void *dst_, size_t n,      \
                                                    int64_t world)                               \
    {                                                                                            \
        const T *acc = (const T *)acc_;                                                          \
        T *dst = (T *)dst_;                                                                      \
        const T w = (T)world;                                                                    \
        for (size_t i = 0; i < n; i++)                                                           \
            dst[i] = acc[i] / w;                                                                 \
    }

/* n / d == (t + ((n - t) >> sh1)) >> sh2 with t = (m * n) >> L, for the L of rs_magic_make. */
typedef struct { uint64_t m; unsigned sh1, sh2; } rs_magic;

static inline rs_magic rs_magic_make(uint64_t d, unsigned bits) /* 1 <= d < 2^bits */
{
    unsigned l = d > 1 ? 64u - (unsigned)__builtin_clzll(d - 1) : 0u; /* ceil(log2(d)) <= bits */
#ifdef __SIZEOF_INT128__
    unsigned __int128 num = (((unsigned __int128)1 << l) - d) << bits; /* 2^L (2^l - d) */
#else /* only bits <= 32 get here: 64-bit AVG uses the hardware divider (RS_DEF_AVG_DIVIDE) */
    uint64_t num = ((1ull << l) - d) << bits;
#endif
    rs_magic r = {(uint64_t)(num / d) + 1, l ? 1u : 0u, l ? l - 1u : 0u}; /* m < 2^L */
    return r;
}

/* True when every |acc[i]| < world, so that every quotient is 0 (and the divisor may not fit). */
static inline int rs_avg_is_zero(int64_t world, size_t itemsize)
{
    return itemsize < 8 && ((uint64_t)world >> (8 * itemsize)) != 0;
}

/* The integer dtypes: RS_DEF_AVG_INT_<isa>(ISA, name, T, UL, L, WIDE, SIGNED, VEC) with UL the
 * unsigned type of the L-bit lanes, WIDE a type that holds an L x L-bit product (without a
 * 128-bit type, 64-bit AVG uses the hardware divider), VEC the element width in bits. */
#define RS_DEF_AVG_i8(ISA, name, T) RS_DEF_AVG_INT_##ISA(ISA, name, T, uint16_t, 16, uint32_t, 1, 8)
#define RS_DEF_AVG_u8(ISA, name, T) RS_DEF_AVG_INT_##ISA(ISA, name, T, uint16_t, 16, uint32_t, 0, 8)
#define RS_DEF_AVG_i32(ISA, name, T) RS_DEF_AVG_INT_##ISA(ISA, name, T, uint32_t, 32, uint64_t, 1, 32)
#define RS_DEF_AVG_u32(ISA, name, T) RS_DEF_AVG_INT_##ISA(ISA, name, T, uint32_t, 32, uint64_t, 0, 32)
#ifdef __SIZEOF_INT128__
#define RS_DEF_AVG_i64(ISA, name, T) RS_DEF_AVG_INT_##ISA(ISA, name, T, uint64_t, 64, unsigned __int128, 1, 64)
#define RS_DEF_AVG_u64(ISA, name, T) RS_DEF_AVG_INT_##ISA(ISA, name, T, uint64_t, 64, unsigned __int128, 0, 64)
#else
#define RS_DEF_AVG_i64(ISA, name, T) RS_DEF_AVG_DIVIDE(ISA, name, T)
#define RS_DEF_AVG_u64(ISA, name, T) RS_DEF_AVG_DIVIDE(ISA, name, T)
#endif
#define RS_DEF_AVG_f32(ISA, name, T) RS_DEF_AVG_FLT(ISA, name, T)
#define RS_DEF_AVG_f64(ISA, name, T) RS_DEF_AVG_FLT(ISA, name, T)

#define RS_DEF_AVG_DIVIDE(ISA, name, T)                                                          \
    static RS_ATTR_##ISA void rs_avg_##name##_##ISA(const void *acc_, void *dst_, size_t n,      \
                                                    int64_t world)                               \
    {                                                                                            \
        const T *acc = (const T *)acc_;                                                          \
        T *dst = (T *)dst_;                                                                      \
        for (size_t i = 0; i < n; i++)                                                           \
            dst[i] = (T)(acc[i] / world);                                                        \
    }

/* Scalar (baseline): plain C, which gcc vectorises where the target allows. */
#define RS_DEF_AVG_INT_baseline(ISA, name, T, UL, L, WIDE, SIGNED, VEC)                         \
    static RS_ATTR_##ISA void rs_avg_##name##_##ISA(const void *acc_, void *dst_, size_t n,      \
                                                    int64_t world)                               \
    {                                                                                            \
        const T *acc = (const T *)acc_;                                                          \
        T *dst = (T *)dst_;                                                                      \
        if (rs_avg_is_zero(world, sizeof(T))) {                                                  \
            memset(dst, 0, n * sizeof(T));                                                       \
            return;                                                                              \
        }                                                                                        \
        const rs_magic r = rs_magic_make((uint64_t)world, L);                                    \
        const UL m = (UL)r.m;                                                                    \
        const unsigned sh1 = r.sh1, sh2 = r.sh2;                                                 \
        for (size_t i = 0; i < n; i++) {                                                         \
            UL a = (UL)acc[i]; /* sign- or zero-extended to L bits */                            \
            UL neg = SIGNED ? (UL)(0 - (UL)(a >> (L - 1))) : 0; /* all ones if negative */      \
            UL mag = (UL)((a ^ neg) - neg);                                                      \
            UL t = (UL)(((WIDE)m * mag) >> L);                                                   \
            UL q = (UL)((UL)(t + (UL)((UL)(mag - t) >> sh1)) >> sh2);                            \
            dst[i] = (T)(UL)((q ^ neg) - neg);                                                   \
        }                                                                                        \
    }

/* SIMD: per ISA, RS_VI_<isa> (an integer vector of RS_VB_<isa> bytes), rs_vi_<op><L>_<isa> for
 * op in set1/add/sub/srl (by a count in an __m128i)/sign (all ones in negative lanes)/mulhi
 * (unsigned high half), and rs_vi_load<VEC><s|u>_<isa> / rs_vi_store<VEC>_<isa> that widen
 * VEC-bit elements to the lanes and back (RS_VB_<isa> * 8 / L of them). */
#define RS_DEF_AVG_INT_SIMD(ISA, name, T, UL, L, WIDE, SIGNED, VEC)                             \
    static RS_ATTR_##ISA void rs_avg_##name##_##ISA(const void *acc_, void *dst_, size_t n,      \
                                                    int64_t world)                               \
    {                                                                                            \
        const T *acc = (const T *)acc_;                                                          \
        T *dst = (T *)dst_;                                                                      \
        const size_t lanes = RS_VB_##ISA * 8 / L;                                                \
        size_t i = 0;                                                                            \
        if (rs_avg_is_zero(world, sizeof(T))) {                                                  \
            memset(dst, 0, n * sizeof(T));                                                       \
            return;                                                                              \
        }                                                                                        \
        const rs_magic r = rs_magic_make((uint64_t)world, L);                                    \
        const RS_VI_##ISA m = rs_vi_set1##L##_##ISA(r.m);                                        \
        const __m128i sh1 = _mm_cvtsi32_si128((int)r.sh1), sh2 = _mm_cvtsi32_si128((int)r.sh2); \
        for (; i + lanes <= n; i += lanes) {                                                     \
            RS_VI_##ISA a = SIGNED ? rs_vi_load##VEC##s_##ISA(acc + i)                           \
                                   : rs_vi_load##VEC##u_##ISA(acc + i);                          \
            RS_VI_##ISA neg = SIGNED ? rs_vi_sign##L##_##ISA(a) : rs_vi_set1##L##_##ISA(0);      \
            RS_VI_##ISA mag = rs_vi_sub##L##_##ISA(rs_vi_xor_##ISA(a, neg), neg);                \
            RS_VI_##ISA t = rs_vi_mulhi##L##_##ISA(mag, m);                                      \
            RS_VI_##ISA q = rs_vi_srl##L##_##ISA(                                                \
                rs_vi_add##L##_##ISA(t, rs_vi_srl##L##_##ISA(rs_vi_sub##L##_##ISA(mag, t), sh1)), \
                sh2);                                                                            \
            rs_vi_store##VEC##_##ISA(dst + i, rs_vi_sub##L##_##ISA(rs_vi_xor_##ISA(q, neg), neg)); \
        }                                                                                        \
        for (; i < n; i++)                                                                       \
            dst[i] = (T)(acc[i] / world);                                                        \
    }
#define RS_DEF_AVG_INT_avx2 RS_DEF_AVG_INT_SIMD
#define RS_DEF_AVG_INT_avx512 RS_DEF_AVG_INT_SIMD

#define RS_DEF_SAME(ISA, CODE, name, T, U, KIND)                                                 \
    RS_ACC_OPS(RS_DEF_SAME_ACC, ISA, CODE, name, T, U, KIND)                                     \
    RS_DEF_AVG_##name(ISA, name, T)

#define RS_SET_SAME_ACC(ISA, CODE, name, T, U, KIND, op)                                        \
    t->acc[CODE][RS_OPCODE_##op] = rs_acc_##name##_##op##_##ISA;
#define RS_SET_SAME(ISA, CODE, name, T, U, KIND)                                                 \
    RS_ACC_OPS(RS_SET_SAME_ACC, ISA, CODE, name, T, U, KIND)                                     \
    t->acc[CODE][RS_AVG] = rs_acc_##name##_sum_##ISA;                                            \
    t->store_avg[CODE] = rs_avg_##name##_##ISA;

/* ---------------------------------------------------------------------------------------- */
/* 16-bit kernels, scalar form (the baseline).                                               */

#define RS_DEF_HALF_ACC_SCALAR(ISA, CODE, name, op)                                             \
    static RS_ATTR_##ISA void rs_acc_##name##_##op##_##ISA(void *acc_, const void *src_, size_t n) \
    {                                                                                           \
        float *acc = (float *)acc_;                                                             \
        const uint16_t *src = (const uint16_t *)src_;                                           \
        for (size_t i = 0; i < n; i++) {                                                        \
            float a = acc[i], b = rs_##name##_to_f32(src[i]);                                   \
            acc[i] = RS_OP_##op##_FLT(float, float, a, b);                                      \
        }                                                                                       \
    }

#define RS_DEF_HALF_SCALAR(ISA, CODE, name)                                                      \
    RS_ACC_OPS(RS_DEF_HALF_ACC_SCALAR, ISA, CODE, name)                                          \
    static RS_ATTR_##ISA void rs_load_##name##_##ISA(void *acc_, const void *src_, size_t n)     \
    {                                                                                            \
        float *acc = (float *)acc_;                                                              \
        const uint16_t *src = (const uint16_t *)src_;                                            \
        for (size_t i = 0; i < n; i++)                                                           \
            acc[i] = rs_##name##_to_f32(src[i]);                                                 \
    }                                                                                            \
    static RS_ATTR_##ISA void rs_store_##name##_##ISA(const void *acc_, void *dst_, size_t n,    \
                                                      int64_t world)                             \
    {                                                                                            \
        const float *acc = (const float *)acc_;                                                  \
        uint16_t *dst = (uint16_t *)dst_;                                                        \
        (void)world;                                                                             \
        for (size_t i = 0; i < n; i++)                                                           \
            dst[i] = rs_f32_to_##name(acc[i]);                                                   \
    }                                                                                            \
    static RS_ATTR_##ISA void rs_avg_##name##_##ISA(const void *acc_, void *dst_, size_t n,      \
                                                    int64_t world)                               \
    {                                                                                            \
        const float *acc = (const float *)acc_;                                                  \
        uint16_t *dst = (uint16_t *)dst_;                                                        \
        const float w = (float)world;                                                            \
        for (size_t i = 0; i < n; i++)                                                           \
            dst[i] = rs_f32_to_##name(acc[i] / w);                                               \
    }

#define RS_SET_HALF_ACC(ISA, CODE, name, op) t->acc[CODE][RS_OPCODE_##op] = rs_acc_##name##_##op##_##ISA;
#define RS_SET_HALF(ISA, CODE, name)                                                             \
    RS_ACC_OPS(RS_SET_HALF_ACC, ISA, CODE, name)                                                 \
    t->acc[CODE][RS_AVG] = rs_acc_##name##_sum_##ISA;                                            \
    t->load[CODE] = rs_load_##name##_##ISA;                                                      \
    t->store[CODE] = rs_store_##name##_##ISA;                                                    \
    t->store_avg[CODE] = rs_avg_##name##_##ISA;

/* ---------------------------------------------------------------------------------------- */
/* 16-bit kernels, SIMD form. Each ISA provides, for its float vector type RS_V_<isa> of       */
/* RS_VW_<isa> lanes: rs_v_<op>_<isa>(a, b) for op in sum/prod/max/min (with the scalar ops'  */
/* exact semantics), rs_v_div_<isa>, rs_v_load/store_<isa> (float32), and                     */
/* rs_v_widen_<f16|bf16>_<isa>(const uint16_t *) / rs_v_narrow_<f16|bf16>_<isa>(uint16_t *, v). */
/* Loop tails use the scalar conversions, which give the same bits.                           */

#define RS_DEF_HALF_ACC_SIMD(ISA, CODE, name, op)                                               \
    static RS_ATTR_##ISA void rs_acc_##name##_##op##_##ISA(void *acc_, const void *src_, size_t n) \
    {                                                                                           \
        float *acc = (float *)acc_;                                                             \
        const uint16_t *src = (const uint16_t *)src_;                                           \
        size_t i = 0;                                                                           \
        for (; i + 2 * RS_VW_##ISA <= n; i += 2 * RS_VW_##ISA) {                                \
            RS_V_##ISA a0 = rs_v_load_##ISA(acc + i);                                           \
            RS_V_##ISA a1 = rs_v_load_##ISA(acc + i + RS_VW_##ISA);                             \
            RS_V_##ISA b0 = rs_v_widen_##name##_##ISA(src + i);                                 \
            RS_V_##ISA b1 = rs_v_widen_##name##_##ISA(src + i + RS_VW_##ISA);                   \
            rs_v_store_##ISA(acc + i, rs_v_##op##_##ISA(a0, b0));                               \
            rs_v_store_##ISA(acc + i + RS_VW_##ISA, rs_v_##op##_##ISA(a1, b1));                 \
        }                                                                                       \
        for (; i < n; i++) {                                                                    \
            float a = acc[i], b = rs_##name##_to_f32(src[i]);                                   \
            acc[i] = RS_OP_##op##_FLT(float, float, a, b);                                      \
        }                                                                                       \
    }

#define RS_DEF_HALF_SIMD(ISA, CODE, name)                                                        \
    RS_ACC_OPS(RS_DEF_HALF_ACC_SIMD, ISA, CODE, name)                                            \
    static RS_ATTR_##ISA void rs_load_##name##_##ISA(void *acc_, const void *src_, size_t n)     \
    {                                                                                            \
        float *acc = (float *)acc_;                                                              \
        const uint16_t *src = (const uint16_t *)src_;                                            \
        size_t i = 0;                                                                            \
        for (; i + RS_VW_##ISA <= n; i += RS_VW_##ISA)                                           \
            rs_v_store_##ISA(acc + i, rs_v_widen_##name##_##ISA(src + i));                       \
        for (; i < n; i++)                                                                       \
            acc[i] = rs_##name##_to_f32(src[i]);                                                 \
    }                                                                                            \
    static RS_ATTR_##ISA void rs_store_##name##_##ISA(const void *acc_, void *dst_, size_t n,    \
                                                      int64_t world)                             \
    {                                                                                            \
        const float *acc = (const float *)acc_;                                                  \
        uint16_t *dst = (uint16_t *)dst_;                                                        \
        size_t i = 0;                                                                            \
        (void)world;                                                                             \
        for (; i + RS_VW_##ISA <= n; i += RS_VW_##ISA)                                           \
            rs_v_narrow_##name##_##ISA(dst + i, rs_v_load_##ISA(acc + i));                       \
        for (; i < n; i++)                                                                       \
            dst[i] = rs_f32_to_##name(acc[i]);                                                   \
    }                                                                                            \
    static RS_ATTR_##ISA void rs_avg_##name##_##ISA(const void *acc_, void *dst_, size_t n,      \
                                                    int64_t world)                               \
    {                                                                                            \
        const float *acc = (const float *)acc_;                                                  \
        uint16_t *dst = (uint16_t *)dst_;                                                        \
        const float w = (float)world;                                                            \
        size_t i = 0;                                                                            \
        for (; i + RS_VW_##ISA <= n; i += RS_VW_##ISA)                                           \
            rs_v_narrow_##name##_##ISA(dst + i, rs_v_div_##ISA(rs_v_load_##ISA(acc + i), w));    \
        for (; i < n; i++)                                                                       \
            dst[i] = rs_f32_to_##name(acc[i] / w);                                               \
    }

/* ---------------------------------------------------------------------------------------- */
/* Instantiation                                                                             */

/* ---------------------------------------------------------------------------------------- */
/* Block-scaled int8 (docs/protocol.md, "Formats"): n elements as blocks of `block` (the last  */
/* may be shorter), each a float32 scale s then its int8 values q; element = s * q, rounded    */
/* to float32, then added to the float32 accumulator (a multiply and an add, never fused: the  */
/* extension is built with -ffp-contract=off, so every level gives the same bits as NumPy).    */
/* Encoding: s = absmax / 127 and q = nearest-even(x * (127 / absmax)); a block holding a NaN  */
/* or an infinity gets s = NaN and q = 0, so it decodes as NaN throughout; a block whose       */
/* absmax is below 2^-96 (zeros, or too small for 127 / absmax) gets s = 0 and q = 0.          */

#define RS_I8B_NAN_BITS 0x7fc00000u
#define RS_I8B_TINY_BITS 0x0f800000u /* 2^-96 */
#define RS_I8B_ROUNDER 12582912.0f   /* 1.5 * 2^23: x + it - it rounds |x| < 2^22 to nearest even */

/* The per-block loops, plain (the baseline: gcc vectorises them for its target) and SIMD (AVX2
 * intrinsics, which the AVX-512 level uses too: its 512-bit converts gain nothing on a loop bound
 * by memory). Both give the same bits; a loop's tail uses the plain form. */
static inline void rs_i8b_decode_plain(float *a, const int8_t *q, size_t m, float s, int add)
{
    if (add)
        for (size_t j = 0; j < m; j++)
            a[j] += s * (float)q[j];
    else
        for (size_t j = 0; j < m; j++)
            a[j] = s * (float)q[j];
}
static inline uint32_t rs_i8b_absmax_plain(const float *x, size_t m, uint32_t mx)
{ /* as bits: |x| orders like its bits, and a NaN's are above an infinity's */
    const uint32_t *b = (const uint32_t *)x;
    for (size_t j = 0; j < m; j++) {
        uint32_t v = b[j] & 0x7fffffffu;
        mx = v > mx ? v : mx;
    }
    return mx;
}
static inline void rs_i8b_quantize_plain(const float *x, int8_t *q, size_t m, float inv)
{
    for (size_t j = 0; j < m; j++) {
        float r = (x[j] * inv + RS_I8B_ROUNDER) - RS_I8B_ROUNDER;
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        q[j] = (int8_t)(int32_t)r;
    }
}

#if RS_X86
static inline RS_ATTR_avx2 void rs_i8b_decode8_avx2(float *a, __m128i q8, __m256 vs, int add)
{
    __m256 v = _mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    _mm256_storeu_ps(a, add ? _mm256_add_ps(_mm256_loadu_ps(a), v) : v);
}
static inline RS_ATTR_avx2 void rs_i8b_decode_simd(float *a, const int8_t *q, size_t m, float s, int add)
{
    const __m256 vs = _mm256_set1_ps(s);
    size_t j = 0;
    for (; j + 32 <= m; j += 32) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(q + j));
        __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
        rs_i8b_decode8_avx2(a + j, lo, vs, add);
        rs_i8b_decode8_avx2(a + j + 8, _mm_srli_si128(lo, 8), vs, add);
        rs_i8b_decode8_avx2(a + j + 16, hi, vs, add);
        rs_i8b_decode8_avx2(a + j + 24, _mm_srli_si128(hi, 8), vs, add);
    }
    for (; j + 8 <= m; j += 8)
        rs_i8b_decode8_avx2(a + j, _mm_loadl_epi64((const __m128i *)(q + j)), vs, add);
    rs_i8b_decode_plain(a + j, q + j, m - j, s, add);
}
static inline RS_ATTR_avx2 uint32_t rs_i8b_absmax_simd(const float *x, size_t m, uint32_t mx)
{
    const __m256i mask = _mm256_set1_epi32(0x7fffffff);
    __m256i v = _mm256_setzero_si256();
    size_t j = 0;
    for (; j + 8 <= m; j += 8)
        v = _mm256_max_epu32(v, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + j)), mask));
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
    uint32_t top = (uint32_t)_mm_cvtsi128_si32(h);
    return rs_i8b_absmax_plain(x + j, m - j, top > mx ? top : mx);
}
static inline RS_ATTR_avx2 __m256i rs_i8b_round8_avx2(const float *x, __m256 vinv)
{ /* nearest even, as the plain form's rounder gives for |x * inv| <= 127 */
    __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_max_ps(_mm256_min_ps(r, _mm256_set1_ps(127.0f)), _mm256_set1_ps(-127.0f));
    return _mm256_cvtps_epi32(r);
}
static inline RS_ATTR_avx2 void rs_i8b_quantize_simd(const float *x, int8_t *q, size_t m, float inv)
{
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lane interleave */
    size_t j = 0;
    for (; j + 32 <= m; j += 32) {
        __m256i ab = _mm256_packs_epi32(rs_i8b_round8_avx2(x + j, vinv), rs_i8b_round8_avx2(x + j + 8, vinv));
        __m256i cd = _mm256_packs_epi32(rs_i8b_round8_avx2(x + j + 16, vinv), rs_i8b_round8_avx2(x + j + 24, vinv));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order));
    }
    rs_i8b_quantize_plain(x + j, q + j, m - j, inv);
}
#endif

/* Per ISA: the walk over blocks, with the per-block loops of IMPL (plain or simd). */
#define RS_DEF_I8B(ISA, IMPL)                                                                    \
    static RS_ATTR_##ISA void rs_i8b_fold_##ISA(float *acc, const unsigned char *src, size_t n,  \
                                                size_t block, int add)                           \
    {                                                                                            \
        for (size_t off = 0; off < n; off += block) {                                            \
            size_t m = n - off < block ? n - off : block;                                        \
            float s;                                                                             \
            memcpy(&s, src, 4);                                                                  \
            rs_i8b_decode_##IMPL(acc + off, (const int8_t *)(src + 4), m, s, add);               \
            src += 4 + m;                                                                        \
        }                                                                                        \
    }                                                                                            \
    static RS_ATTR_##ISA void rs_i8b_load_##ISA(float *acc, const unsigned char *src, size_t n,  \
                                                size_t block)                                    \
    {                                                                                            \
        rs_i8b_fold_##ISA(acc, src, n, block, 0);                                                \
    }                                                                                            \
    static RS_ATTR_##ISA void rs_i8b_acc_##ISA(float *acc, const unsigned char *src, size_t n,   \
                                               size_t block)                                     \
    {                                                                                            \
        rs_i8b_fold_##ISA(acc, src, n, block, 1);                                                \
    }                                                                                            \
    static RS_ATTR_##ISA void rs_i8b_store_##ISA(const float *acc, unsigned char *dst, size_t n, \
                                                 size_t block)                                   \
    {                                                                                            \
        for (size_t off = 0; off < n; off += block) {                                            \
            size_t m = n - off < block ? n - off : block;                                        \
            uint32_t mx = rs_i8b_absmax_##IMPL(acc + off, m, 0);                                 \
            float s = 0.0f;                                                                      \
            if (mx >= 0x7f800000u || mx < RS_I8B_TINY_BITS) {                                    \
                s = mx >= 0x7f800000u ? rs_bits_f32(RS_I8B_NAN_BITS) : 0.0f;                     \
                memset(dst + 4, 0, m);                                                           \
            } else {                                                                             \
                float amax = rs_bits_f32(mx);                                                    \
                s = amax / 127.0f;                                                               \
                rs_i8b_quantize_##IMPL(acc + off, (int8_t *)(dst + 4), m, 127.0f / amax);        \
            }                                                                                    \
            memcpy(dst, &s, 4);                                                                  \
            dst += 4 + m;                                                                        \
        }                                                                                        \
    }

#define RS_SET_I8B(ISA)                                                                          \
    t->i8b_load = rs_i8b_load_##ISA;                                                             \
    t->i8b_acc = rs_i8b_acc_##ISA;                                                               \
    t->i8b_store = rs_i8b_store_##ISA;

RS_SAME_TYPES(RS_DEF_SAME, baseline)
RS_HALF_TYPES(RS_DEF_HALF_SCALAR, baseline)
RS_DEF_I8B(baseline, plain)

static void rs_fill_baseline(rs_table *t)
{
    RS_SAME_TYPES(RS_SET_SAME, baseline)
    RS_HALF_TYPES(RS_SET_HALF, baseline)
    RS_SET_I8B(baseline)
}

#if RS_X86

/* Integer vector helpers that AVX2 and AVX-512 spell alike but for the prefix (P: _mm256 or
 * _mm512) and the width of the whole-register operations (SI: si256 or si512). */
#define RS_VI_DEF_COMMON(ISA, P, SI)                                                             \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_set116_##ISA(uint64_t x) { return P##_set1_epi16((short)x); } \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_set132_##ISA(uint64_t x) { return P##_set1_epi32((int)x); } \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_xor_##ISA(RS_VI_##ISA a, RS_VI_##ISA b) { return P##_xor_##SI(a, b); } \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_sign16_##ISA(RS_VI_##ISA a) { return P##_srai_epi16(a, 15); } \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_sign32_##ISA(RS_VI_##ISA a) { return P##_srai_epi32(a, 31); } \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_mulhi16_##ISA(RS_VI_##ISA a, RS_VI_##ISA b)    \
    {                                                                                            \
        return P##_mulhi_epu16(a, b);                                                            \
    }                                                                                            \
    RS_VI_DEF_ARITH(ISA, P, 16) RS_VI_DEF_ARITH(ISA, P, 32) RS_VI_DEF_ARITH(ISA, P, 64)
#define RS_VI_DEF_ARITH(ISA, P, L)                                                               \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_add##L##_##ISA(RS_VI_##ISA a, RS_VI_##ISA b)   \
    {                                                                                            \
        return P##_add_epi##L(a, b);                                                             \
    }                                                                                            \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_sub##L##_##ISA(RS_VI_##ISA a, RS_VI_##ISA b)   \
    {                                                                                            \
        return P##_sub_epi##L(a, b);                                                             \
    }                                                                                            \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_srl##L##_##ISA(RS_VI_##ISA a, __m128i count)   \
    {                                                                                            \
        return P##_srl_epi##L(a, count);                                                         \
    }
/* 64 x 64 -> high 64 bits from four 32 x 32 -> 64 products; no partial sum overflows. */
#define RS_VI_DEF_MULHI64(ISA, P, SI)                                                            \
    static inline RS_ATTR_##ISA RS_VI_##ISA rs_vi_mulhi64_##ISA(RS_VI_##ISA a, RS_VI_##ISA b)    \
    {                                                                                            \
        RS_VI_##ISA ah = P##_srli_epi64(a, 32), bh = P##_srli_epi64(b, 32);                      \
        RS_VI_##ISA ll = P##_mul_epu32(a, b), lh = P##_mul_epu32(a, bh);                         \
        RS_VI_##ISA hl = P##_mul_epu32(ah, b), hh = P##_mul_epu32(ah, bh);                       \
        RS_VI_##ISA mid = P##_add_epi64(P##_add_epi64(P##_srli_epi64(ll, 32), lh),               \
                                        P##_and_##SI(hl, rs_vi_set164_##ISA(0xffffffff)));       \
        return P##_add_epi64(P##_add_epi64(hh, P##_srli_epi64(hl, 32)), P##_srli_epi64(mid, 32)); \
    }

/* --- AVX2 + F16C: 8 float lanes ---------------------------------------------------------- */
#define RS_V_avx2 __m256
#define RS_VW_avx2 8

static inline RS_ATTR_avx2 __m256 rs_v_load_avx2(const float *p) { return _mm256_loadu_ps(p); }
static inline RS_ATTR_avx2 void rs_v_store_avx2(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline RS_ATTR_avx2 __m256 rs_v_sum_avx2(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static inline RS_ATTR_avx2 __m256 rs_v_prod_avx2(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
static inline RS_ATTR_avx2 __m256 rs_v_div_avx2(__m256 a, float w)
{
    return _mm256_div_ps(a, _mm256_set1_ps(w));
}
/* vmaxps/vminps return the second operand when either is NaN (or on equality): that handles a
 * NaN in b; a NaN in a is blended back in. Same results as RS_OP_max_FLT / RS_OP_min_FLT. */
static inline RS_ATTR_avx2 __m256 rs_v_max_avx2(__m256 a, __m256 b)
{
    return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
static inline RS_ATTR_avx2 __m256 rs_v_min_avx2(__m256 a, __m256 b)
{
    return _mm256_blendv_ps(_mm256_min_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
static inline RS_ATTR_avx2 __m256 rs_v_widen_f16_avx2(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline RS_ATTR_avx2 void rs_v_narrow_f16_avx2(uint16_t *p, __m256 v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline RS_ATTR_avx2 __m256 rs_v_widen_bf16_avx2(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline RS_ATTR_avx2 void rs_v_narrow_bf16_avx2(uint16_t *p, __m256 v)
{
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256i quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x00400000));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i r = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
    /* eight 32-bit values < 0x10000 -> eight uint16 */
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* Integer vectors for AVG (see RS_DEF_AVG_INT_SIMD). */
#define RS_VI_avx2 __m256i
#define RS_VB_avx2 32
static inline RS_ATTR_avx2 __m256i rs_vi_set164_avx2(uint64_t x) { return _mm256_set1_epi64x((long long)x); }
RS_VI_DEF_COMMON(avx2, _mm256, si256)
static inline RS_ATTR_avx2 __m256i rs_vi_sign64_avx2(__m256i a)
{
    return _mm256_cmpgt_epi64(_mm256_setzero_si256(), a); /* no 64-bit arithmetic shift */
}
/* b: the same 32-bit value in every lane. vpmuludq multiplies the even lanes into 64 bits. */
static inline RS_ATTR_avx2 __m256i rs_vi_mulhi32_avx2(__m256i a, __m256i b)
{
    __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(a, b), 32);
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), b);
    return _mm256_blend_epi32(even, odd, 0xAA);
}
RS_VI_DEF_MULHI64(avx2, _mm256, si256)
static inline RS_ATTR_avx2 __m256i rs_vi_load8s_avx2(const void *p)
{
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}
static inline RS_ATTR_avx2 __m256i rs_vi_load8u_avx2(const void *p)
{
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}
static inline RS_ATTR_avx2 void rs_vi_store8_avx2(void *p, __m256i v) /* the low byte of each lane */
{
    v = _mm256_and_si256(v, _mm256_set1_epi16(0xff));
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
static inline RS_ATTR_avx2 __m256i rs_vi_load32s_avx2(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
#define rs_vi_load32u_avx2 rs_vi_load32s_avx2
#define rs_vi_load64s_avx2 rs_vi_load32s_avx2
#define rs_vi_load64u_avx2 rs_vi_load32s_avx2
static inline RS_ATTR_avx2 void rs_vi_store32_avx2(void *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }
#define rs_vi_store64_avx2 rs_vi_store32_avx2

/* --- AVX-512 F/BW/VL: 16 float lanes --------------------------------------------------- */
#define RS_V_avx512 __m512
#define RS_VW_avx512 16

static inline RS_ATTR_avx512 __m512 rs_v_load_avx512(const float *p) { return _mm512_loadu_ps(p); }
static inline RS_ATTR_avx512 void rs_v_store_avx512(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline RS_ATTR_avx512 __m512 rs_v_sum_avx512(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static inline RS_ATTR_avx512 __m512 rs_v_prod_avx512(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
static inline RS_ATTR_avx512 __m512 rs_v_div_avx512(__m512 a, float w)
{
    return _mm512_div_ps(a, _mm512_set1_ps(w));
}
static inline RS_ATTR_avx512 __m512 rs_v_max_avx512(__m512 a, __m512 b)
{
    return _mm512_mask_mov_ps(_mm512_max_ps(a, b), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
}
static inline RS_ATTR_avx512 __m512 rs_v_min_avx512(__m512 a, __m512 b)
{
    return _mm512_mask_mov_ps(_mm512_min_ps(a, b), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
}
static inline RS_ATTR_avx512 __m512 rs_v_widen_f16_avx512(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline RS_ATTR_avx512 void rs_v_narrow_f16_avx512(uint16_t *p, __m512 v)
{
    _mm256_storeu_si256((__m256i *)p,
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline RS_ATTR_avx512 __m512 rs_v_widen_bf16_avx512(const uint16_t *p)
{
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline RS_ATTR_avx512 void rs_v_narrow_bf16_avx512(uint16_t *p, __m512 v)
{
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __m512i quiet = _mm512_or_si512(x, _mm512_set1_epi32(0x00400000));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i r = _mm512_srli_epi32(_mm512_mask_mov_epi32(rounded, nan, quiet), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

/* Integer vectors for AVG (see RS_DEF_AVG_INT_SIMD). */
#define RS_VI_avx512 __m512i
#define RS_VB_avx512 64
static inline RS_ATTR_avx512 __m512i rs_vi_set164_avx512(uint64_t x) { return _mm512_set1_epi64((long long)x); }
RS_VI_DEF_COMMON(avx512, _mm512, si512)
static inline RS_ATTR_avx512 __m512i rs_vi_sign64_avx512(__m512i a) { return _mm512_srai_epi64(a, 63); }
static inline RS_ATTR_avx512 __m512i rs_vi_mulhi32_avx512(__m512i a, __m512i b) /* as for AVX2 */
{
    __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(a, b), 32);
    __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), b);
    return _mm512_mask_mov_epi32(even, 0xAAAA, odd);
}
RS_VI_DEF_MULHI64(avx512, _mm512, si512)
static inline RS_ATTR_avx512 __m512i rs_vi_load8s_avx512(const void *p)
{
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
static inline RS_ATTR_avx512 __m512i rs_vi_load8u_avx512(const void *p)
{
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
static inline RS_ATTR_avx512 void rs_vi_store8_avx512(void *p, __m512i v) /* truncating */
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi16_epi8(v));
}
static inline RS_ATTR_avx512 __m512i rs_vi_load32s_avx512(const void *p) { return _mm512_loadu_si512(p); }
#define rs_vi_load32u_avx512 rs_vi_load32s_avx512
#define rs_vi_load64s_avx512 rs_vi_load32s_avx512
#define rs_vi_load64u_avx512 rs_vi_load32s_avx512
static inline RS_ATTR_avx512 void rs_vi_store32_avx512(void *p, __m512i v) { _mm512_storeu_si512(p, v); }
#define rs_vi_store64_avx512 rs_vi_store32_avx512

RS_SAME_TYPES(RS_DEF_SAME, avx2)
RS_HALF_TYPES(RS_DEF_HALF_SIMD, avx2)
RS_SAME_TYPES(RS_DEF_SAME, avx512)
RS_HALF_TYPES(RS_DEF_HALF_SIMD, avx512)
RS_DEF_I8B(avx2, simd)
RS_DEF_I8B(avx512, simd)

static void rs_fill_avx2(rs_table *t)
{
    RS_SAME_TYPES(RS_SET_SAME, avx2)
    RS_HALF_TYPES(RS_SET_HALF, avx2)
    RS_SET_I8B(avx2)
}
static void rs_fill_avx512(rs_table *t)
{
    RS_SAME_TYPES(RS_SET_SAME, avx512)
    RS_HALF_TYPES(RS_SET_HALF, avx512)
    RS_SET_I8B(avx512)
}
#endif /* RS_X86 */

/* ---------------------------------------------------------------------------------------- */
/* Dispatch                                                                                  */

static rs_table rs_tables[RS_NISAS];
static int rs_isa_ok[RS_NISAS];
static int rs_best_isa = RS_ISA_BASELINE;
static const rs_table *rs_active = &rs_tables[RS_ISA_BASELINE];
static int rs_active_isa = RS_ISA_BASELINE;

/* Fill the tables and select the best level this CPU supports. Call once, with the GIL. */
static void rs_init(void)
{
    rs_fill_baseline(&rs_tables[RS_ISA_BASELINE]);
    rs_isa_ok[RS_ISA_BASELINE] = 1;
#if RS_X86
    __builtin_cpu_init();
    /* __builtin_cpu_supports also checks that the OS saves the AVX / AVX-512 state. */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        rs_fill_avx2(&rs_tables[RS_ISA_AVX2]);
        rs_isa_ok[RS_ISA_AVX2] = 1;
        rs_best_isa = RS_ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl")) {
            rs_fill_avx512(&rs_tables[RS_ISA_AVX512]);
            rs_isa_ok[RS_ISA_AVX512] = 1;
            rs_best_isa = RS_ISA_AVX512;
        }
    }
#endif
    rs_active_isa = rs_best_isa;
    rs_active = &rs_tables[rs_best_isa];
}

/* Force a level (tests, benchmarks). Returns -1 if this CPU or build cannot run it. Not
 * thread-safe against kernels running at the same time on other threads. */
static int rs_select_isa(int isa)
{
    if (isa < 0 || isa >= RS_NISAS || !rs_isa_ok[isa])
        return -1;
    rs_active_isa = isa;
    rs_active = &rs_tables[isa];
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Entry points. Arguments are validated by the caller; these return -1 on a bad code only.   */

static int rs_load(int dtype, void *acc, const void *src, size_t n)
{
    if (dtype < 0 || dtype >= RS_NDTYPES)
        return -1;
    if (n == 0)
        return 0;
    if (rs_active->load[dtype])
        rs_active->load[dtype](acc, src, n);
    else if (acc != src)
        memcpy(acc, src, n * rs_itemsizes[dtype]);
    return 0;
}

static int rs_accumulate(int dtype, int op, void *acc, const void *src, size_t n)
{
    if (dtype < 0 || dtype >= RS_NDTYPES || op < 0 || op >= RS_NOPS)
        return -1;
    if (n)
        rs_active->acc[dtype][op](acc, src, n);
    return 0;
}

static int rs_store(int dtype, int op, const void *acc, void *dst, size_t n, int64_t world)
{
    if (dtype < 0 || dtype >= RS_NDTYPES || op < 0 || op >= RS_NOPS)
        return -1;
    if (n == 0)
        return 0;
    if (op == RS_AVG) {
        if (world < 1)
            return -1;
        rs_active->store_avg[dtype](acc, dst, n, world);
    } else if (rs_active->store[dtype]) {
        rs_active->store[dtype](acc, dst, n, world);
    } else if (acc != dst) {
        memcpy(dst, acc, n * rs_itemsizes[dtype]);
    }
    return 0;
}

/* int8 blocks (block >= 1; the caller checks the sizes): acc = decode(src), acc += decode(src),
 * dst = encode(acc). */
static void rs_i8b_load(float *acc, const void *src, size_t n, size_t block)
{
    rs_active->i8b_load(acc, (const unsigned char *)src, n, block);
}
static void rs_i8b_accumulate(float *acc, const void *src, size_t n, size_t block)
{
    rs_active->i8b_acc(acc, (const unsigned char *)src, n, block);
}
static void rs_i8b_store(const float *acc, void *dst, size_t n, size_t block)
{
    rs_active->i8b_store(acc, (unsigned char *)dst, n, block);
}

#endif /* REDUCTION_SERVER_KERNELS_H */
