/* fp8ptq CPU kernels, shared definitions: one fused pass per tensor for the codecs, the
 * calibration observer, the weight sweep and the decode (codec.c, observe.c, sweep.c, decode.c,
 * threads.c; fp8ptq/runtime/native.py compiles them into one library).
 *
 * Built on first use by fp8ptq/runtime/native.py with the system C compiler (cc -O3 -march=native, no
 * fast-math: every floating-point operation is the same IEEE operation, in the same order, as
 * the pure-torch path in fp8ptq/formats/codec.py and fp8ptq/observe/observers.py, so the results are
 * bit-identical; tests/test_native.py checks that for every format, rounding mode, source dtype
 * and scale layout). Why C and not more torch ops: the torch path makes a dozen elementwise
 * passes with float32 temporaries per tensor; this makes one, reading the source (float32,
 * bfloat16 or float16) and writing the result, so it runs near memory bandwidth.
 */

#ifndef FP8PTQ_COMMON_H
#define FP8PTQ_COMMON_H

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
    /* Encoding by lookup (formats not IEEE-like: HiFloat8), where the rounding to the nearest
     * grid point (half even or half away, saturating or not) is decided by the float32's top
     * bits: sign, exponent, the widest binade's kept mantissa bits and the first dropped bit
     * (``u >> lut_shift``), plus for half-even whether any lower bit is set (``lut_sticky``:
     * key = top << 1 | any). ``code_lut[key]`` is then the code of every value with that key
     * but NaN, which takes ``lut_nan[sign]``. native.py fills it from this kernel's own
     * arithmetic path and checks every key (NULL: no table). */
    const uint8_t *code_lut;
    int32_t lut_shift, lut_sticky, lut_nan[2];
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
    /* > 0 with scale_per_row: one scale per ``group`` consecutive values of each row (the last
     * group may be partial), scale[row * ceil(cols / group) + col / group] */
    int64_t group;
} job_t;

/* The scale of element ``i`` of a job that has one */
static inline float scale_of(const job_t *j, int64_t i) {
    if (j->scale_per_row && j->group > 0) {
        int64_t r = i / j->cols, groups = (j->cols + j->group - 1) / j->group;
        return j->scale[r * groups + (i - r * j->cols) / j->group];
    }
    return j->scale[j->scale_per_row ? i / j->cols : j->scale_per_col ? i % j->cols : 0];
}

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

/* threads.c: plain pthreads (torch's OpenMP pool is not reachable from C without its headers,
 * and a second OpenMP runtime in the process would spin against it) */
#define HIDDEN __attribute__((visibility("hidden")))
/* Run ``fn`` on each of the ``t`` parts (``size`` bytes apart from ``parts``): part 0 on the
 * calling thread, the others on fresh threads (inline when a thread cannot be created). */
HIDDEN void fork_join(void *(*fn)(void *), void *parts, size_t size, int t);
/* Threads worth starting for ``n`` elements (at most ``nthreads``). */
HIDDEN int thread_count(int64_t n, int nthreads);
/* Rows [at[k], at[k + 1]) for each of the returned number of threads (whole rows each). */
HIDDEN int row_split(int64_t rows, int64_t cols, int nthreads, int64_t *at);

#endif
