/* fp8ptq CPU kernels: one fused pass per tensor for the codecs and the calibration observer.
 *
 * Built on first use by fp8ptq/native.py with the system C compiler (cc -O3 -march=native, no
 * fast-math: every floating-point operation below is the same IEEE operation, in the same
 * order, as the pure-torch path in fp8ptq/formats/codec.py and fp8ptq/observers.py, so the
 * results are bit-identical; tests/test_native.py checks that for every format, rounding mode,
 * source dtype and scale layout). Why C and not more torch ops: the torch path makes a dozen
 * elementwise passes with float32 temporaries per tensor; this makes one, reading the source
 * (float32, bfloat16 or float16) and writing the result, so it runs near memory bandwidth.
 *
 * Threads: plain pthreads splitting the element range (torch's OpenMP pool is not reachable
 * from C without its headers, and a second OpenMP runtime in the process would spin against
 * it).
 */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { R_NEAREST_EVEN = 0, R_HALF_AWAY = 1, R_STOCHASTIC = 2, R_HYBRID = 3 };
enum { OUT_VALUES = 0, OUT_SAME = 1, OUT_CODES = 2 };
#define MAX_THREADS 64
#define MIN_PER_THREAD 32768
/* the vector helpers must melt into each specialised loop (a call per 8 lanes costs more than
 * the work) */
#define VINLINE static inline __attribute__((always_inline))

/* What fp8ptq/formats knows about a format, flattened (native.py fills it from the layout and
 * the binade tables of fp8ptq/formats/binades.py). Tables are indexed by the float32 exponent
 * field (0..255) and hold integers: the hot loops build powers of two from them with shifts
 * (integer tables let gcc vectorise the lookups; float tables beside float stores do not). */
typedef struct {
    int32_t step_log2[256];  /* log2 of the grid spacing of that binade (clamped binades) */
    int32_t first_bits[256]; /* float32 bits of the binade's smallest grid magnitude */
    int32_t first_rank[256]; /* its index among the non-negative magnitudes */
    int32_t codes[256];      /* code of each non-negative magnitude, by rank */
    float max;               /* largest finite magnitude */
    float overflow;          /* what a magnitude above max becomes: max, inf or nan */
    float int_max;           /* integer formats: the symmetric clamp */
    int32_t rounding;
    int32_t is_int;          /* symmetric integer grid (round half even, clamp, NaN -> 0) */
    int32_t negzero;         /* the format has -0 */
    int32_t nan_to_zero;
    int32_t sign_bit, has_inf, inf_code, has_nan, nan_code, code_mask;
    /* IEEE-like formats (every preset but HiFloat8): the tables above are arithmetic, which the
     * 8-lane loops use instead of lookups. step_log2 of binade e is ``e < lin_lo ? lin_slo :
     * min(e, lin_hi) - mbits``; the code of a grid magnitude a >= 2^lin_lo is its float32 bits
     * >> (23 - mbits) minus ``lin_code_off``, below that a * 2^(mbits - lin_lo). */
    int32_t linear, lin_lo, lin_slo, lin_hi, mbits, lin_codes, lin_code_off;
    /* Tapered grids (HiFloat8), where codes run consecutively within each binade: the code of
     * a grid magnitude whose float32 significand (with the implicit bit) is M is
     * ``(pack >> 5) - 256 + (M >> (pack & 31))``, pack = code_pack[exponent field]: one lookup
     * instead of four (native.py checks the formula on every magnitude; packed = 0 otherwise). */
    int32_t packed;
    int32_t code_pack[256];
    /* Tapered grids described arithmetically (HiFloat8: 3 mantissa bits near 2^0, fewer
     * further out): with E the exponent clamped to [taper_lo, taper_hi], the spacing is
     * 2^(E - w), w = taper_w0 minus the number of thresholds taper_t[k] <= |E| (unused
     * thresholds are 1 << 20). native.py sets ``tapered`` only when this reproduces step_log2
     * for all 256 fields; the loops then need no lookup to round. */
    int32_t tapered, taper_lo, taper_hi, taper_w0, taper_t[4];
} fmt_t;

typedef struct {
    const void *src;
    int32_t src_dtype;
    void *dst;
    int32_t out_kind;
    const float *scale;  /* NULL: no scale */
    int32_t scale_per_row, scale_per_col;
    const float *rand;   /* uniforms for stochastic rounding, one per element */
    int64_t n, cols;
    const fmt_t *fmt;
} job_t;

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float pow2(int32_t e) { return u2f((uint32_t)(127 + e) << 23); }

#ifdef __FLT16_MAX__
#define HAVE_F16 1
static inline float h2f(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t f2h(float f) { _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h; }
#else
#define HAVE_F16 0
static inline float h2f(uint16_t h) { (void)h; return NAN; }
static inline uint16_t f2h(float f) { (void)f; return 0x7e00; }
#endif

/* float -> bfloat16, round half to even, NaN -> 0x7fc0 (c10::BFloat16's conversion). */
static inline uint16_t f2bf(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7fc0u : r);
}

static inline float load(const void *src, int32_t dtype, int64_t i) {
    if (dtype == DT_BF16) return u2f((uint32_t)((const uint16_t *)src)[i] << 16);
    if (dtype == DT_F16) return h2f(((const uint16_t *)src)[i]);
    return ((const float *)src)[i];
}

/* The magnitude |y| on the binade's grid: whole steps and the fraction of a step left over
 * (codec._quantize_dense: y * 2^-step, floor; exact, a multiplication by a power of two). */
#define GRID_SPLIT(slog_tab, y, yb, field, sl, whole, frac)                                   \
    uint32_t yb = f2u(y);                                                                     \
    uint32_t field = (yb & 0x7fffffffu) >> 23;                                                \
    int32_t sl = (slog_tab)[field];                                                           \
    float whole, frac;                                                                        \
    {                                                                                         \
        float t_ = u2f(yb & 0x7fffffffu) * pow2(-sl);                                         \
        whole = floorf(t_);                                                                   \
        frac = t_ - whole;                                                                    \
    }

/* ... and back: (whole + up) * 2^step, overflow, sign, no -0 where the format has none. */
static inline float grid_value(float whole, float up, int32_t sl, uint32_t yb, float fmax,
                               float ovf, int negzero) {
    float q = (whole + up) * pow2(sl);
    q = q > fmax ? ovf : q;
    q = u2f((f2u(q) & 0x7fffffffu) | (yb & 0x80000000u));
    return (!negzero && q == 0.0f) ? 0.0f : q;
}

static inline int round_half_even(float whole, float frac) {
    return (frac > 0.5f) | ((frac == 0.5f) & (whole - 2.0f * floorf(whole * 0.5f) == 1.0f));
}

/* codec._quantize_dense / _round_up / _simplified_sr for one float32 value ``y``. ``low16``:
 * the 16-bit source pattern (SR2 of the hybrid rounding reads its last bit), ``sr2``: whether
 * the source was 16-bit and unscaled. */
static inline float quantize_float(const fmt_t *f, float y, float u, uint32_t low16, int sr2) {
    GRID_SPLIT(f->step_log2, y, yb, field, sl, whole, frac)
    int up;
    switch (f->rounding) {
    case R_NEAREST_EVEN:
        up = round_half_even(whole, frac);
        break;
    case R_HALF_AWAY:
        up = frac >= 0.5f;
        break;
    case R_STOCHASTIC:
        up = u < frac;
        break;
    default: { /* R_HYBRID: Luo et al. 2024 eq. (3) */
        int e = (int)field - 127;
        if (e > -4 && e < 4) {
            up = frac >= 0.5f;
        } else if (sr2) {
            float f2 = floorf(frac * 4.0f);
            up = f2 >= (float)((low16 & 1u) * 2u + 1u);
        } else {
            float f14 = floorf(frac * 16384.0f);
            up = (frac > 0.0f) & (f14 >= (float)(yb & 0x3fffu));
        }
    }
    }
    float q = grid_value(whole, (float)up, sl, yb, f->max, f->overflow, f->negzero);
    return (f->nan_to_zero && q != q) ? 0.0f : q;
}

static inline float quantize_int(const fmt_t *f, float y) {
    float q = nearbyintf(y);
    q = q < -f->int_max ? -f->int_max : q;
    q = q > f->int_max ? f->int_max : q;
    return q != q ? 0.0f : q;
}

/* codec._encode_dense after the rounding: the code of grid value ``q`` (the rank of |q| is
 * arithmetic within its binade, codec._grid_codes). */
static inline int32_t float_code(const int32_t *restrict step_log2,
                                 const int32_t *restrict first_bits,
                                 const int32_t *restrict first_rank,
                                 const int32_t *restrict codes, float q, int32_t sign_bit,
                                 int negzero, int has_inf, int32_t inf_code, int has_nan,
                                 int32_t nan_code) {
    uint32_t qb = f2u(q);
    uint32_t ab = qb & 0x7fffffffu;
    int finite = ab < 0x7f800000u;
    ab = finite ? ab : 0u;
    uint32_t field = ab >> 23;
    float rank = (u2f(ab) - u2f((uint32_t)first_bits[field])) * pow2(-step_log2[field]) +
                 (float)first_rank[field];
    int32_t code = codes[(int32_t)rank];
    int negative = (qb >> 31) & ((q != 0.0f) | negzero);
    code = negative ? code | sign_bit : code;
    if (has_inf) code = (!finite && q == q) ? inf_code | (int32_t)((qb >> 31) ? sign_bit : 0) : code;
    if (has_nan) code = q != q ? nan_code : code;
    return code;
}

static inline uint8_t code_of(const fmt_t *f, float q) {
    if (f->is_int) return (uint8_t)((int32_t)q & f->code_mask);
    return (uint8_t)float_code(f->step_log2, f->first_bits, f->first_rank, f->codes, q,
                               f->sign_bit, f->negzero, f->has_inf, f->inf_code, f->has_nan,
                               f->nan_code);
}

static void run_range(const job_t *j, int64_t lo, int64_t hi) {
    const fmt_t *f = j->fmt;
    int sr2 = j->src_dtype != DT_F32 && j->scale == NULL;
    for (int64_t i = lo; i < hi; i++) {
        float x = load(j->src, j->src_dtype, i);
        float s = 1.0f;
        if (j->scale) s = j->scale[j->scale_per_row ? i / j->cols : j->scale_per_col ? i % j->cols : 0];
        float y = j->scale ? x / s : x;
        float q;
        if (f->is_int) {
            q = quantize_int(f, y);
        } else {
            uint32_t low16 = sr2 ? ((const uint16_t *)j->src)[i] : 0u;
            q = quantize_float(f, y, j->rand ? j->rand[i] : 0.0f, low16, sr2);
        }
        if (j->out_kind == OUT_CODES) {
            ((uint8_t *)j->dst)[i] = code_of(f, q);
        } else if (j->out_kind == OUT_VALUES) {
            ((float *)j->dst)[i] = q;
        } else {
            float v = j->scale ? q * s : q;
            if (j->src_dtype == DT_BF16) ((uint16_t *)j->dst)[i] = f2bf(v);
            else if (j->src_dtype == DT_F16) ((uint16_t *)j->dst)[i] = f2h(v);
            else ((float *)j->dst)[i] = v;
        }
    }
}

/* ---- 8-lane blocks for the hot cases: round half even / half away, saturating, float32 or
 * bfloat16 source, fake-quantized values or codes out. GCC/Clang vector extensions (AVX2 on
 * x86, NEON pairs on ARM; no intrinsics): the same IEEE operations as quantize_float,
 * quantize_int and code_of, lane by lane. IEEE-like formats compute their per-binade spacing
 * and codes arithmetically; HiFloat8's tapered grid reads the tables with eight scalar loads
 * per block (AMD's gather instruction is no faster, and this stays portable). ---- */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));

enum { K_LINEAR = 0, K_TABLE = 1, K_INT = 2 };

VINLINE v8f vsel(v8i m, v8f a, v8f b) { return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }
VINLINE v8i visel(v8i m, v8i a, v8i b) { return (a & m) | (b & ~m); }
VINLINE v8i vsplat(int32_t v) { return (v8i){0} + v; }
VINLINE v8f vsplatf(float v) { return (v8f){0} + v; }
VINLINE v8i vgather(const int32_t *restrict t, v8u i) {
    return (v8i){t[i[0]], t[i[1]], t[i[2]], t[i[3]], t[i[4]], t[i[5]], t[i[6]], t[i[7]]};
}
VINLINE v8f vpow2(v8i e) { return (v8f)((v8u)(e + 127) << 23); }
VINLINE v8i vmin(v8i a, v8i b) { return visel(a < b, a, b); }

/* floorf of non-negative (or NaN / inf) lanes: below 2^23 truncation is the floor, above it
 * every float is an integer already. */
VINLINE v8f vfloor_pos(v8f t) {
    v8i small = t < 8388608.0f;
    v8f tin = vsel(small, t, (v8f){0});
    v8f tr = __builtin_convertvector(__builtin_convertvector(tin, v8i), v8f);
    return vsel(small, tr, t);
}

VINLINE v8f vload(const void *src, int dtype, int64_t k) {
    if (dtype == DT_BF16) {
        v8h h;
        memcpy(&h, (const uint16_t *)src + k, sizeof h);
        return (v8f)(__builtin_convertvector(h, v8u) << 16);
    }
    v8f x;
    memcpy(&x, (const float *)src + k, sizeof x);
    return x;
}

/* step_log2 of the binade of each lane's float32 exponent field */
VINLINE v8i vstep_log2(const fmt_t *f, v8u field, int kind) {
    if (kind == K_TABLE && f->tapered) {
        v8i e = (v8i)field - 127;
        e = visel(e < f->taper_lo, vsplat(f->taper_lo), visel(e > f->taper_hi,
                                                               vsplat(f->taper_hi), e));
        v8i a = visel(e < 0, -e, e);
        v8i w = vsplat(f->taper_w0) + (a >= f->taper_t[0]) + (a >= f->taper_t[1]) +
                (a >= f->taper_t[2]) + (a >= f->taper_t[3]);  /* true lanes are -1 */
        return e - w;
    }
    if (kind == K_TABLE) return vgather(f->step_log2, field);
    v8i e = (v8i)field - 127;
    return visel(e < f->lin_lo, vsplat(f->lin_slo), vmin(e, vsplat(f->lin_hi)) - f->mbits);
}

/* vquantize for IEEE-like grids rounded half to even, in integer operations on the float32
 * bits: in the normal binades the grid keeps ``mbits`` mantissa bits, so rounding is adding
 * half a step minus one plus the kept lowest bit, then clearing the dropped bits (a carry moves
 * into the exponent by itself); below the smallest normal the spacing is fixed, 2^slo, and one
 * float addition of C = 2^(slo + 23) rounds to it (|y| < C, so the sum's ulp is that spacing;
 * IEEE addition rounds half to even) and subtracting C back is exact. Same values as the
 * floor / fraction form below, bit for bit (NaN keeps its payload, quietened, like the
 * multiplications there); a third of the operations. */
VINLINE v8f vquantize_rne_linear(const fmt_t *f, v8f y) {
    v8u yb = (v8u)y;
    v8u ab = yb & 0x7fffffffu;
    const int drop = 23 - f->mbits;
    /* the kept significand's lowest bit (with no mantissa bits it is the implicit 1: odd) */
    v8u odd = f->mbits ? (ab >> drop) & 1u : (v8u){0} + 1u;
    v8u r = (ab + ((1u << (drop - 1)) - 1u) + odd) & ~((1u << drop) - 1u);
    const float c = pow2(f->lin_slo + 23);
    v8u sub = (v8u)(((v8f)ab + c) - c);
    v8i normal = (v8i)ab >= (int32_t)((uint32_t)(127 + f->lin_lo) << 23);
    v8i q = visel(normal, (v8i)r, (v8i)sub);
    q = visel(q > (int32_t)f2u(f->max), vsplat((int32_t)f2u(f->overflow)), q);
    q = visel((v8i)ab > 0x7f800000, (v8i)(ab | 0x400000u), q);
    if (!f->negzero) return (v8f)((v8u)q | (yb & 0x80000000u & (v8u)(q != 0)));
    return (v8f)((v8u)q | (yb & 0x80000000u));
}

VINLINE v8f vquantize(const fmt_t *f, v8f y, int kind, int rounding) {
    if (kind == K_LINEAR && rounding == R_NEAREST_EVEN) return vquantize_rne_linear(f, y);
    v8u yb = (v8u)y;
    v8u ab = yb & 0x7fffffffu;
    if (kind == K_INT) {  /* quantize_int: round half even is sign * rint(|y|) */
        v8f a = (v8f)ab;
        v8f r = (a + 8388608.0f) - 8388608.0f;  /* exact rint below 2^23 */
        r = vsel(a < 8388608.0f, r, a);
        r = vsel(r > f->int_max, vsplatf(f->int_max), r);
        v8f q = (v8f)((v8u)r | (yb & 0x80000000u));
        return vsel(y != y, (v8f){0}, q);
    }
    v8i sl = vstep_log2(f, ab >> 23, kind);
    v8f t = (v8f)ab * vpow2(-sl);
    v8f whole = vfloor_pos(t);
    v8f frac = t - whole;
    v8i up;
    if (rounding == R_NEAREST_EVEN) {
        v8f odd = whole - 2.0f * vfloor_pos(whole * 0.5f);
        up = (frac > 0.5f) | ((frac == 0.5f) & (odd == 1.0f));
    } else {
        up = frac >= 0.5f;
    }
    v8f q = (whole + (v8f)(up & (v8i)vsplatf(1.0f))) * vpow2(sl);
    q = vsel(q > f->max, vsplatf(f->overflow), q);
    q = (v8f)(((v8u)q & 0x7fffffffu) | (yb & 0x80000000u));
    if (!f->negzero) q = vsel(q == 0.0f, (v8f){0}, q);
    return q;
}

VINLINE v8i vcode(const fmt_t *f, v8f q, int kind) {
    if (kind == K_INT) return __builtin_convertvector(q, v8i) & f->code_mask;
    v8u qb = (v8u)q;
    v8u ab = qb & 0x7fffffffu;
    v8i finite = (v8i)ab < 0x7f800000;  /* signed compares: ab < 2^31 (AVX2 has no unsigned) */
    ab = (v8u)((v8i)ab & finite);
    v8i code;
    if (kind == K_LINEAR && f->lin_codes) {
        v8i normal = (v8i)ab >= (int32_t)((uint32_t)(127 + f->lin_lo) << 23);
        v8i sub = __builtin_convertvector((v8f)ab * pow2(f->mbits - f->lin_lo), v8i);
        code = visel(normal, (v8i)(ab >> (23 - f->mbits)) - f->lin_code_off, sub);
    } else if (kind == K_TABLE && f->packed) {
        v8u field = ab >> 23;
        v8i pack = vgather(f->code_pack, field);
        v8u m = (ab & 0x7fffffu) | (v8u)((v8i)(field != 0) & 0x800000);
        code = ((pack >> 5) - 256) + (v8i)(m >> (v8u)(pack & 31));
    } else {
        v8u field = ab >> 23;
        v8f first = (v8f)vgather(f->first_bits, field);
        v8f rank = ((v8f)ab - first) * vpow2(-vstep_log2(f, field, kind)) +
                   __builtin_convertvector(vgather(f->first_rank, field), v8f);
        code = vgather(f->codes, (v8u)__builtin_convertvector(rank, v8i));
    }
    v8i sign = (v8i)(qb >> 31);
    v8i neg = sign & ((q != 0.0f) | vsplat(-(f->negzero != 0))) & 1;
    code = visel(neg != 0, code | f->sign_bit, code);
    v8i nan = q != q;
    if (f->has_inf) code = visel(~finite & ~nan, vsplat(f->inf_code) | (sign * f->sign_bit), code);
    if (f->has_nan) code = visel(nan, vsplat(f->nan_code), code);
    return code;
}

VINLINE v8u vbf16_bits(v8f v) {  /* f2bf, lane by lane */
    v8u u = (v8u)v;
    v8u r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (v8u)visel(v != v, vsplat(0x7fc0), (v8i)r);
}

/* The low byte / low half of each 32-bit lane (a truncating narrow: lanes hold codes < 256 and
 * bfloat16 patterns). A byte shuffle, where __builtin_convertvector goes lane by lane through
 * general registers. */
typedef uint8_t v32b __attribute__((vector_size(32)));
typedef uint16_t v16h __attribute__((vector_size(32)));
VINLINE v8b narrow8(v8i v) {
    v32b b = (v32b)v;
    return __builtin_shufflevector(b, b, 0, 4, 8, 12, 16, 20, 24, 28);
}
VINLINE v8h narrow16(v8u v) {
    v16h h = (v16h)v;
    return __builtin_shufflevector(h, h, 0, 2, 4, 6, 8, 10, 12, 14);
}

/* Elements [lo, hi) of one row (one scale ``s``; ``scaled`` = 0 means no scale). Always
 * inlined into one function per (kind, source dtype, output, rounding) below, so that the
 * branches on them are resolved at compile time and the loop body is straight vector code. */
static inline __attribute__((always_inline)) void
fast_span(const job_t *j, int64_t lo, int64_t hi, float s, const int scaled, const int kind,
          const int dtype, const int out_kind, const int rounding) {
    const fmt_t *f = j->fmt;
    int64_t k = lo;
    for (; k + 8 <= hi; k += 8) {
        v8f x = vload(j->src, dtype, k);
        v8f y = scaled ? x / s : x;
        v8f q = vquantize(f, y, kind, rounding);
        if (out_kind == OUT_CODES) {
            v8b c = narrow8(vcode(f, q, kind));
            memcpy((uint8_t *)j->dst + k, &c, sizeof c);
        } else {
            v8f v = scaled ? q * s : q;
            if (dtype == DT_BF16) {
                v8h h = narrow16(vbf16_bits(v));
                memcpy((uint16_t *)j->dst + k, &h, sizeof h);
            } else {
                memcpy((float *)j->dst + k, &v, sizeof v);
            }
        }
    }
    for (; k < hi; k++) {  /* the tail, one element at a time (same operations) */
        float y = load(j->src, dtype, k);
        y = scaled ? y / s : y;
        float q = kind == K_INT ? quantize_int(f, y) : quantize_float(f, y, 0.0f, 0u, 0);
        if (out_kind == OUT_CODES) ((uint8_t *)j->dst)[k] = code_of(f, q);
        else if (dtype == DT_BF16) ((uint16_t *)j->dst)[k] = f2bf(scaled ? q * s : q);
        else ((float *)j->dst)[k] = scaled ? q * s : q;
    }
}

static inline __attribute__((always_inline)) void
fast_range(const job_t *jp, int64_t lo, int64_t hi, const int kind, const int dtype,
           const int out_kind, const int rounding) {
    /* Private copies of the job and the format: the output is written through a uint8_t /
     * uint16_t pointer, which C lets alias anything, so with the caller's structs the compiler
     * reloads every format field after each store; nothing can point into these locals. */
    fmt_t fmt = *jp->fmt;
    job_t job = *jp;
    job.fmt = &fmt;
    const job_t *j = &job;
    if (!j->scale) {
        fast_span(j, lo, hi, 1.0f, 0, kind, dtype, out_kind, rounding);
        return;
    }
    if (!j->scale_per_row) {
        fast_span(j, lo, hi, j->scale[0], 1, kind, dtype, out_kind, rounding);
        return;
    }
    for (int64_t i = lo; i < hi;) {
        int64_t r = i / j->cols, end = (r + 1) * j->cols < hi ? (r + 1) * j->cols : hi;
        fast_span(j, i, end, j->scale[r], 1, kind, dtype, out_kind, rounding);
        i = end;
    }
}

typedef void (*range_fn)(const job_t *, int64_t, int64_t);

#define FAST(K, DT, OUT, RND)                                                                  \
    static void fast_##K##_##DT##_##OUT##_##RND(const job_t *j, int64_t lo, int64_t hi) {     \
        fast_range(j, lo, hi, K, DT, OUT, RND);                                                \
    }
#define FAST_ROUNDINGS(K, DT, OUT) FAST(K, DT, OUT, R_NEAREST_EVEN) FAST(K, DT, OUT, R_HALF_AWAY)
#define FAST_OUTS(K, DT) FAST_ROUNDINGS(K, DT, OUT_SAME) FAST_ROUNDINGS(K, DT, OUT_CODES)
#define FAST_DTYPES(K) FAST_OUTS(K, DT_F32) FAST_OUTS(K, DT_BF16)
FAST_DTYPES(K_LINEAR)
FAST_DTYPES(K_TABLE)
FAST_DTYPES(K_INT)

#define ENTRY(K, DT, OUT, RND) fast_##K##_##DT##_##OUT##_##RND
#define ENTRIES_R(K, DT, OUT) {ENTRY(K, DT, OUT, R_NEAREST_EVEN), ENTRY(K, DT, OUT, R_HALF_AWAY)}
#define ENTRIES_O(K, DT) {ENTRIES_R(K, DT, OUT_SAME), ENTRIES_R(K, DT, OUT_CODES)}
#define ENTRIES_D(K) {ENTRIES_O(K, DT_F32), ENTRIES_O(K, DT_BF16)}
static const range_fn FAST_FNS[3][2][2][2] = {ENTRIES_D(K_LINEAR), ENTRIES_D(K_TABLE),
                                              ENTRIES_D(K_INT)};

static range_fn pick(const job_t *j) {
    const fmt_t *f = j->fmt;
    if (f->nan_to_zero || j->scale_per_col || j->out_kind == OUT_VALUES) return run_range;
    if (f->rounding != R_NEAREST_EVEN && f->rounding != R_HALF_AWAY) return run_range;
    if (j->src_dtype != DT_F32 && j->src_dtype != DT_BF16) return run_range;
    if (j->out_kind == OUT_SAME && !j->scale) return run_range;
    int kind = f->is_int ? K_INT : f->linear ? K_LINEAR : K_TABLE;
    return FAST_FNS[kind][j->src_dtype == DT_BF16][j->out_kind == OUT_CODES]
                   [f->rounding == R_HALF_AWAY];
}

typedef struct {
    const job_t *job;
    range_fn fn;
    int64_t lo, hi;
} part_t;

static void *run_part(void *arg) {
    part_t *p = (part_t *)arg;
    p->fn(p->job, p->lo, p->hi);
    return NULL;
}

/* Run ``fn`` on each of the ``t`` parts (``size`` bytes apart from ``parts``): part 0 on the
 * calling thread, the others on fresh threads (inline when a thread cannot be created). */
static void fork_join(void *(*fn)(void *), void *parts, size_t size, int t) {
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    char *base = (char *)parts;
    for (int k = 1; k < t; k++)
        started[k] = pthread_create(&tids[k], NULL, fn, base + (size_t)k * size) == 0;
    fn(base);
    for (int k = 1; k < t; k++) {
        if (started[k]) pthread_join(tids[k], NULL);
        else fn(base + (size_t)k * size);
    }
}

static int thread_count(int64_t n, int nthreads) {
    int64_t t = n / MIN_PER_THREAD;
    if (t > nthreads) t = nthreads;
    if (t > MAX_THREADS) t = MAX_THREADS;
    return t < 1 ? 1 : (int)t;
}

/* Run ``fn`` over [0, n) on up to ``nthreads`` threads (split at multiples of ``align``). */
static void parallel(const job_t *j, range_fn fn, int64_t n, int nthreads, int64_t align) {
    int t = thread_count(n, nthreads);
    part_t parts[MAX_THREADS];
    int64_t per = (n + t - 1) / t;
    per = (per + align - 1) / align * align;
    for (int k = 0; k < t; k++) {
        int64_t lo = k * per, hi = lo + per < n ? lo + per : n;
        parts[k] = (part_t){j, fn, lo < n ? lo : n, hi};
    }
    fork_join(run_part, parts, sizeof parts[0], t);
}

int fp8ptq_have_f16(void) { return HAVE_F16; }

/* Ask for transparent huge pages on the 2 MiB-aligned interior of a fresh output buffer: the
 * kernels write it once, and first-touch faults on 4 KiB pages cost more than the kernel
 * itself on a 64 MB output (the THP setting "madvise" is the common default). */
void fp8ptq_advise_huge(void *p, int64_t n) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)1 << 21;
    uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t e = ((uintptr_t)p + (uintptr_t)n) & ~(huge - 1);
    if (e > a) madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

/* Quantize ``n`` elements: out_kind 0 = float32 grid values (quantize_values), 1 = fake-quantized
 * values in the source dtype (fake_quantize), 2 = uint8 codes (encode). */
void fp8ptq_quantize(const fmt_t *fmt, const void *src, int32_t src_dtype, void *dst,
                     int32_t out_kind, const float *scale, int32_t per_row, int32_t per_col,
                     const float *rand, int64_t n, int64_t cols, int32_t nthreads) {
    job_t j = {src, src_dtype, dst, out_kind, scale, per_row, per_col, rand, n,
               cols > 0 ? cols : 1, fmt};
    parallel(&j, pick(&j), n, nthreads, 16);
}

/* ---- calibration observer: observers.TensorStats.update in one pass ---- */

typedef struct {
    const void *src;
    int32_t dtype;
    int64_t rows, cols;
    int32_t nbins, shift, first;
    float *chan;        /* [nthreads][cols] partial channel amax */
    int64_t *hist;      /* [nthreads][4][nbins] partial histograms */
    int64_t *nonfinite; /* [nthreads] */
    void *scratch;      /* [nthreads][cols] floats or uint16 bin / magnitude rows */
    uint16_t *chan16;   /* bfloat16: [nthreads][cols] channel amax as 15-bit magnitudes */
    uint32_t *raw;      /* bfloat16: [nthreads][4][RAW_BINS] counts by |x| bits >> 2 */
    int32_t raw_shift;  /* bfloat16: shift - 16 (the histogram bin from the 16-bit pattern) */
} obs_t;

#define RAW_BINS(o) ((0x7fff >> (o)->raw_shift) + 1)

typedef struct {
    const obs_t *o;
    int part;
    int64_t r0, r1;
} obs_part_t;

/* Count one row's bin indices ``idx[0..cols)`` into four interleaved histograms of ``nb`` bins
 * each (consecutive elements hit different copies: no store-to-load stalls on repeated bins). */
#define COUNT_ROW(hist, nb, idx, cols)                                                         \
    do {                                                                                       \
        int64_t c_ = 0;                                                                        \
        for (; c_ + 4 <= (cols); c_ += 4) {                                                    \
            (hist)[(idx)[c_]]++;                                                               \
            (hist)[(nb) + (idx)[c_ + 1]]++;                                                    \
            (hist)[2 * (nb) + (idx)[c_ + 2]]++;                                                \
            (hist)[3 * (nb) + (idx)[c_ + 3]]++;                                                \
        }                                                                                      \
        for (; c_ < (cols); c_++) (hist)[(idx)[c_]]++;                                         \
    } while (0)

/* float32 / float16 sources: |x| as float32 bits, the bin from its top bits */
static void observe_generic(const obs_t *o, int part, int64_t r0, int64_t r1) {
    float *chan = o->chan + (int64_t)part * o->cols;
    int64_t *hist = o->hist + (int64_t)part * 4 * o->nbins;
    int64_t bad = 0;
    const int32_t nb = o->nbins, shift = o->shift, base = o->first - 1;
    float *row = (float *)o->scratch + (int64_t)part * 2 * o->cols;
    uint32_t *idx = (uint32_t *)(row + o->cols);
    for (int64_t r = r0; r < r1; r++) {
        int64_t off = r * o->cols;
        if (o->dtype == DT_F16) {
            const uint16_t *s = (const uint16_t *)o->src + off;
            for (int64_t c = 0; c < o->cols; c++) row[c] = h2f(s[c]);
        } else {
            memcpy(row, (const float *)o->src + off, sizeof(float) * (size_t)o->cols);
        }
        int64_t rowbad = 0;
        for (int64_t c = 0; c < o->cols; c++) {
            uint32_t ab = f2u(row[c]) & 0x7fffffffu;
            int finite = ab < 0x7f800000u;
            rowbad += !finite;
            ab = finite ? ab : 0u;
            float a = u2f(ab);
            chan[c] = a > chan[c] ? a : chan[c];
            int32_t b = (int32_t)(ab >> shift) - base;
            b = b < 0 ? 0 : b;
            b = b > nb - 1 ? nb - 1 : b;
            idx[c] = (uint32_t)b;
        }
        bad += rowbad;
        COUNT_ROW(hist, nb, idx, o->cols);
    }
    o->nonfinite[part] = bad;
}

/* bfloat16 sources stay 16-bit: for finite values the magnitude order is the integer order of
 * the 15-bit pattern (channel amax with 16-bit integer max), and the histogram bin of a
 * bfloat16 is its pattern >> 2, so counting patterns and folding them into bins afterwards
 * gives the same counts with no float conversion per element. */
static void observe_bf16(const obs_t *o, int part, int64_t r0, int64_t r1) {
    uint16_t *chan = o->chan16 + (int64_t)part * o->cols;
    const int64_t nraw = RAW_BINS(o);
    uint32_t *h = o->raw + (int64_t)part * 4 * nraw;
    uint16_t *idx = (uint16_t *)o->scratch + (int64_t)part * o->cols;
    const int rs = o->raw_shift;
    int64_t bad = 0;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *restrict s = (const uint16_t *)o->src + r * o->cols;
        uint32_t rowbad = 0;
        for (int64_t c = 0; c < o->cols; c++) {
            uint16_t a = s[c] & 0x7fffu;
            uint16_t nonfinite = a >= 0x7f80u;
            rowbad += nonfinite;
            a = nonfinite ? 0 : a;
            chan[c] = a > chan[c] ? a : chan[c];
            idx[c] = (uint16_t)(a >> rs);
        }
        bad += rowbad;
        COUNT_ROW(h, nraw, idx, o->cols);
    }
    o->nonfinite[part] = bad;
}

static void *observe_part(void *arg) {
    obs_part_t *p = (obs_part_t *)arg;
    if (p->o->dtype == DT_BF16) observe_bf16(p->o, p->part, p->r0, p->r1);
    else observe_generic(p->o, p->part, p->r0, p->r1);
    return NULL;
}

/* Channel amax (max of finite |x| per column, into ``chan_out`` which holds the running
 * values), histogram counts of |x| (non-finite counted as 0, added to ``hist_out``) and the
 * number of non-finite values of a [rows, cols] tensor. Returns 0, or -1 when out of memory. */
int fp8ptq_observe(const void *src, int32_t dtype, int64_t rows, int64_t cols, float *chan_out,
                   int64_t *hist_out, int64_t *nonfinite_out, int32_t nbins, int32_t shift,
                   int32_t first, int32_t nthreads) {
    int t = thread_count(rows * cols, nthreads);
    if (t > rows) t = rows > 0 ? (int)rows : 1;
    int bf16 = dtype == DT_BF16 && shift >= 16 && rows * cols / t < ((int64_t)1 << 31);
    obs_t o = {src, bf16 ? DT_BF16 : dtype, rows, cols, nbins, shift, first, NULL, NULL, NULL,
               NULL, NULL, NULL, shift - 16};
    int64_t bad[MAX_THREADS] = {0};
    o.nonfinite = bad;
    if (bf16) {
        o.chan16 = (uint16_t *)calloc((size_t)t * (size_t)cols, sizeof(uint16_t));
        o.raw = (uint32_t *)calloc((size_t)t * 4 * (size_t)RAW_BINS(&o), sizeof(uint32_t));
        o.scratch = malloc(sizeof(uint16_t) * (size_t)t * (size_t)cols);
    } else {
        o.chan = (float *)calloc((size_t)t * (size_t)cols, sizeof(float));
        o.hist = (int64_t *)calloc((size_t)t * 4 * (size_t)nbins, sizeof(int64_t));
        o.scratch = malloc(sizeof(float) * 2 * (size_t)t * (size_t)cols);
    }
    if (!o.scratch || (bf16 ? !o.chan16 || !o.raw : !o.chan || !o.hist)) {
        free(o.chan); free(o.hist); free(o.scratch); free(o.chan16); free(o.raw);
        return -1;
    }
    obs_part_t parts[MAX_THREADS];
    int64_t per = (rows + t - 1) / t;
    for (int k = 0; k < t; k++) {
        int64_t r0 = k * per, r1 = r0 + per < rows ? r0 + per : rows;
        parts[k] = (obs_part_t){&o, k, r0 < rows ? r0 : rows, r1};
    }
    fork_join(observe_part, parts, sizeof parts[0], t);
    for (int k = 0; k < t; k++) {
        for (int64_t c = 0; c < cols; c++) {
            float a = bf16 ? u2f((uint32_t)o.chan16[(int64_t)k * cols + c] << 16)
                           : o.chan[(int64_t)k * cols + c];
            chan_out[c] = a > chan_out[c] ? a : chan_out[c];
        }
        if (bf16) {
            const int64_t nraw = RAW_BINS(&o), base = first - 1;
            for (int hh = 0; hh < 4; hh++)
                for (int64_t rb = 0; rb < nraw; rb++) {
                    int64_t b = rb - base;
                    b = b < 0 ? 0 : b > nbins - 1 ? nbins - 1 : b;
                    hist_out[b] += o.raw[((int64_t)k * 4 + hh) * nraw + rb];
                }
        } else {
            for (int hh = 0; hh < 4; hh++)
                for (int32_t b = 0; b < nbins; b++)
                    hist_out[b] += o.hist[((int64_t)k * 4 + hh) * nbins + b];
        }
        *nonfinite_out += bad[k];
    }
    free(o.chan); free(o.hist); free(o.scratch); free(o.chan16); free(o.raw);
    return 0;
}

/* ---- the weight sweep: weight_quant.quantize_weight in one pass over the weight ----
 *
 * For each row of a [rows, cols] weight (float32 or bfloat16) with one scale (per tensor or
 * per row): the codes of x / s, and the sums the report needs -- sum x^2 and sum (x - q s)^2
 * (float32 squares accumulated in float64, as ``x.square().sum(dtype=float64)``), the largest
 * finite |x| and the count of non-finite values. The codes are the same bits as encode(x / s)
 * (the same vquantize / vcode); the sums are the same terms, added in another order. */

typedef double v8d __attribute__((vector_size(64)));

/* Rows [at[k], at[k + 1]) for each of the returned number of threads (whole rows each). */
static int row_split(int64_t rows, int64_t cols, int nthreads, int64_t *at) {
    int t = thread_count(rows * cols, nthreads);
    if (t > rows) t = rows < 1 ? 1 : (int)rows;
    int64_t per = (rows + t - 1) / t;
    for (int k = 0; k <= t; k++) at[k] = k * per < rows ? k * per : rows;
    return t;
}

typedef struct {
    const fmt_t *fmt;
    const void *src;
    uint8_t *codes;
    const float *scale;
    int32_t per_row;
    int64_t rows, cols;
    double *signal, *noise;
    float *amax;
    int64_t *bad;  /* [nthreads] */
} sweep_t;


static inline __attribute__((always_inline)) void
sweep_rows(const sweep_t *w, int part, int64_t r0, int64_t r1, const int kind, const int dtype,
           const int rounding) {
    const fmt_t *f = w->fmt;
    const int64_t cols = w->cols;
    int64_t bad = 0;
    for (int64_t r = r0; r < r1; r++) {
        const float s = w->scale[w->per_row ? r : 0];
        const int64_t base = r * cols;
        v8d sig = {0}, noi = {0};
        v8f top = {0};
        v8i nonfinite = {0};
        int64_t k = 0;
        for (; k + 8 <= cols; k += 8) {
            v8f x = vload(w->src, dtype, base + k);
            v8f a = (v8f)((v8u)x & 0x7fffffffu);
            v8i finite = a < INFINITY;
            nonfinite += (~finite) & 1;
            top = vsel(finite & (a > top), a, top);
            v8f q = vquantize(f, x / s, kind, rounding);
            v8b c = __builtin_convertvector(vcode(f, q, kind), v8b);
            memcpy(w->codes + base + k, &c, sizeof c);
            v8f d = x - q * s;
            sig += __builtin_convertvector(x * x, v8d);
            noi += __builtin_convertvector(d * d, v8d);
        }
        double sig_s = 0.0, noi_s = 0.0;
        float top_s = 0.0f;
        for (int l = 0; l < 8; l++) {
            sig_s += sig[l];
            noi_s += noi[l];
            top_s = top[l] > top_s ? top[l] : top_s;
            bad += nonfinite[l];
        }
        for (; k < cols; k++) {  /* the tail, one element at a time (same operations) */
            float x = load(w->src, dtype, base + k);
            float a = fabsf(x);
            if (!(a < INFINITY)) bad++;
            else if (a > top_s) top_s = a;
            float y = x / s;
            float q = kind == K_INT ? quantize_int(f, y) : quantize_float(f, y, 0.0f, 0u, 0);
            w->codes[base + k] = code_of(f, q);
            float d = x - q * s;
            sig_s += (double)(x * x);
            noi_s += (double)(d * d);
        }
        w->signal[r] = sig_s;
        w->noise[r] = noi_s;
        w->amax[r] = top_s;
    }
    w->bad[part] = bad;
}

typedef void (*sweep_fn)(const sweep_t *, int, int64_t, int64_t);

typedef struct {
    const sweep_t *w;
    sweep_fn fn;
    int part;
    int64_t r0, r1;
} sweep_part_t;

#define SWEEP(K, DT, RND)                                                                      \
    static void sweep_##K##_##DT##_##RND(const sweep_t *w, int p, int64_t r0, int64_t r1) {   \
        sweep_rows(w, p, r0, r1, K, DT, RND);                                                  \
    }
#define SWEEP_R(K, DT) SWEEP(K, DT, R_NEAREST_EVEN) SWEEP(K, DT, R_HALF_AWAY)
#define SWEEP_D(K) SWEEP_R(K, DT_F32) SWEEP_R(K, DT_BF16)
SWEEP_D(K_LINEAR)
SWEEP_D(K_TABLE)
SWEEP_D(K_INT)
#define SWEEP_E(K, DT, RND) sweep_##K##_##DT##_##RND
#define SWEEP_ER(K, DT) {SWEEP_E(K, DT, R_NEAREST_EVEN), SWEEP_E(K, DT, R_HALF_AWAY)}
#define SWEEP_ED(K) {SWEEP_ER(K, DT_F32), SWEEP_ER(K, DT_BF16)}
static const sweep_fn SWEEP_FNS[3][2][2] = {SWEEP_ED(K_LINEAR), SWEEP_ED(K_TABLE),
                                            SWEEP_ED(K_INT)};

static void *sweep_part(void *arg) {
    sweep_part_t *p = (sweep_part_t *)arg;
    p->fn(p->w, p->part, p->r0, p->r1);
    return NULL;
}

/* Returns -1 where the sweep does not apply (the caller takes the torch path): rounding other
 * than half-even / half-away, NaN-to-zero formats, sources other than float32 / bfloat16. */
int fp8ptq_weight_sweep(const fmt_t *fmt, const void *src, int32_t dtype, uint8_t *codes,
                        const float *scale, int32_t per_row, int64_t rows, int64_t cols,
                        double *signal, double *noise, float *amax, int64_t *nonfinite,
                        int32_t nthreads) {
    if (fmt->nan_to_zero || (fmt->rounding != R_NEAREST_EVEN && fmt->rounding != R_HALF_AWAY))
        return -1;
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
    int kind = fmt->is_int ? K_INT : fmt->linear ? K_LINEAR : K_TABLE;
    sweep_fn fn = SWEEP_FNS[kind][dtype == DT_BF16][fmt->rounding == R_HALF_AWAY];
    int64_t bad[MAX_THREADS] = {0};
    sweep_t w = {fmt, src, codes, scale, per_row, rows, cols, signal, noise, amax, bad};
    int64_t at[MAX_THREADS + 1];
    int t = row_split(rows, cols, nthreads, at);
    sweep_part_t parts[MAX_THREADS];
    for (int k = 0; k < t; k++) parts[k] = (sweep_part_t){&w, fn, k, at[k], at[k + 1]};
    fork_join(sweep_part, parts, sizeof parts[0], t);
    *nonfinite = 0;
    for (int k = 0; k < t; k++) *nonfinite += bad[k];
    return 0;
}

/* ---- max |x| of each row of a [rows, cols] float32 / bfloat16 matrix, as torch's
 * x.abs().amax(dim=1): NaN anywhere in a row gives NaN. On the magnitude bits as unsigned
 * integers (|x| orders as its bits; every NaN's bits exceed infinity's), so no float compare
 * and no float32 copy of a bfloat16 source. ---- */

typedef struct {
    const void *src;
    int32_t dtype;
    int64_t cols;
    float *out;
    int64_t r0, r1;
} absmax_part_t;

static void *absmax_part(void *arg) {
    const absmax_part_t *p = (const absmax_part_t *)arg;
    for (int64_t r = p->r0; r < p->r1; r++) {
        uint32_t top = 0;
        if (p->dtype == DT_BF16) {
            const uint16_t *x = (const uint16_t *)p->src + r * p->cols;
            uint16_t m = 0;
            for (int64_t k = 0; k < p->cols; k++) {
                uint16_t a = x[k] & 0x7fffu;
                m = a > m ? a : m;
            }
            top = (uint32_t)m << 16;
        } else {
            const uint32_t *x = (const uint32_t *)p->src + r * p->cols;
            for (int64_t k = 0; k < p->cols; k++) {
                uint32_t a = x[k] & 0x7fffffffu;
                top = a > top ? a : top;
            }
        }
        p->out[r] = u2f(top);
    }
    return NULL;
}

void fp8ptq_row_absmax(const void *src, int32_t dtype, int64_t rows, int64_t cols, float *out,
                       int32_t nthreads) {
    int64_t at[MAX_THREADS + 1];
    int t = row_split(rows, cols, nthreads, at);
    absmax_part_t parts[MAX_THREADS];
    for (int k = 0; k < t; k++)
        parts[k] = (absmax_part_t){src, dtype, cols, out, at[k], at[k + 1]};
    fork_join(absmax_part, parts, sizeof parts[0], t);
}

/* ---- decode: codec.dequantize, (decode(codes) * scale).to(dtype) in one pass. Each code reads
 * its float32 value from the format's 256-entry table, is multiplied by its scale (one value,
 * one per row or one per column; none: no multiplication) in float32 and converted to the
 * output dtype with torch's rounding, so a QuantGemm's dequantized weight needs no int64 index
 * copy of the codes and no float32 copy of the weight. ---- */

typedef struct {
    const float *table;
    const uint8_t *codes;
    const float *scale;
    int32_t per_row, per_col, dtype;
    void *dst;
    int64_t cols, r0, r1;
} decode_part_t;

#define DECODE_ROW(STORE)                                                                      \
    for (int64_t k = 0; k < p->cols; k++) {                                                    \
        float v = table[c[k]];                                                                 \
        if (p->scale) v = v * (p->per_col ? p->scale[k] : s);                                  \
        STORE;                                                                                 \
    }

static void *decode_part(void *arg) {
    const decode_part_t *p = (const decode_part_t *)arg;
    float table[256];
    memcpy(table, p->table, sizeof table);
    for (int64_t r = p->r0; r < p->r1; r++) {
        const uint8_t *c = p->codes + r * p->cols;
        float s = p->scale ? p->scale[p->per_row ? r : 0] : 1.0f;
        if (p->dtype == DT_BF16) {
            uint16_t *o = (uint16_t *)p->dst + r * p->cols;
            DECODE_ROW(o[k] = f2bf(v))
        } else if (p->dtype == DT_F16) {
            uint16_t *o = (uint16_t *)p->dst + r * p->cols;
            DECODE_ROW(o[k] = f2h(v))
        } else {
            float *o = (float *)p->dst + r * p->cols;
            DECODE_ROW(o[k] = v)
        }
    }
    return NULL;
}

void fp8ptq_decode(const float *table, const uint8_t *codes, int64_t rows, int64_t cols,
                   const float *scale, int32_t per_row, int32_t per_col, void *dst,
                   int32_t dtype, int32_t nthreads) {
    int64_t at[MAX_THREADS + 1];
    int t = row_split(rows, cols, nthreads, at);
    decode_part_t parts[MAX_THREADS];
    for (int k = 0; k < t; k++)
        parts[k] = (decode_part_t){table, codes, scale, per_row, per_col, dtype, dst, cols,
                                   at[k], at[k + 1]};
    fork_join(decode_part, parts, sizeof parts[0], t);
}
