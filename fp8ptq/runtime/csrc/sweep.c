#include "common.h"
#include "scalar.h"
#include "vec.h"

/* ---- the weight sweep: weight_quant.quantize_weight in one pass over the weight ----
 *
 * For each row of a [rows, cols] weight (float32 or bfloat16) with one scale (per tensor or
 * per row): the codes of x / s, and the sums the report needs -- sum x^2 and sum (x - q s)^2
 * (float32 squares accumulated in float64, as ``x.square().sum(dtype=float64)``), the largest
 * finite |x| and the count of non-finite values. The codes are the same bits as encode(x / s)
 * (the same vquantize / vcode); the sums are the same terms, added in another order. */

typedef double v8d __attribute__((vector_size(64)));

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
    int64_t cols, group;
    float *out;
    int64_t r0, r1;
} absmax_part_t;

static void *absmax_part(void *arg) {
    const absmax_part_t *p = (const absmax_part_t *)arg;
    float *out = p->out + p->r0 * ((p->cols + p->group - 1) / p->group);
    for (int64_t r = p->r0; r < p->r1; r++) {
        for (int64_t g = 0; g < p->cols; g += p->group) {
            int64_t end = g + p->group < p->cols ? g + p->group : p->cols;
            uint32_t top = 0;
            if (p->dtype == DT_BF16) {
                const uint16_t *x = (const uint16_t *)p->src + r * p->cols;
                uint16_t m = 0;
                for (int64_t k = g; k < end; k++) {
                    uint16_t a = x[k] & 0x7fffu;
                    m = a > m ? a : m;
                }
                top = (uint32_t)m << 16;
            } else {
                const uint32_t *x = (const uint32_t *)p->src + r * p->cols;
                for (int64_t k = g; k < end; k++) {
                    uint32_t a = x[k] & 0x7fffffffu;
                    top = a > top ? a : top;
                }
            }
            *out++ = u2f(top);
        }
    }
    return NULL;
}

/* max |x| of each row, or of each ``group`` values of a row (the last group may be partial):
 * out[row * ceil(cols / group) + g] */
void fp8ptq_row_absmax(const void *src, int32_t dtype, int64_t rows, int64_t cols, int64_t group,
                       float *out, int32_t nthreads) {
    int64_t at[MAX_THREADS + 1];
    int t = row_split(rows, cols, nthreads, at);
    absmax_part_t parts[MAX_THREADS];
    if (rows <= 0 || cols <= 0) return;
    group = group > 0 && group < cols ? group : cols;
    for (int k = 0; k < t; k++)
        parts[k] = (absmax_part_t){src, dtype, cols, group, out, at[k], at[k + 1]};
    fork_join(absmax_part, parts, sizeof parts[0], t);
}
