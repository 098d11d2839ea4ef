/* The codecs: quantize to a format's grid, encode to codes, fake-quantize, over a whole tensor
 * (codec.quantize_values / encode / fake_quantize). */

#include "common.h"
#include "scalar.h"
#include "vec.h"

static void run_range(const job_t *j, int64_t lo, int64_t hi) {
    const fmt_t *f = j->fmt;
    int sr2 = j->src_dtype != DT_F32 && j->scale == NULL;
    for (int64_t i = lo; i < hi; i++) {
        float x = load(j->src, j->src_dtype, i);
        float s = 1.0f;
        if (j->scale) s = scale_of(j, i);
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
        if (kind == K_LUT) {
            v8b c = vlut_codes(f, (v8u)y);
            memcpy((uint8_t *)j->dst + k, &c, sizeof c);
            continue;
        }
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
        if (kind == K_LUT) {
            ((uint8_t *)j->dst)[k] = lut_code(f, y);
            continue;
        }
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
    /* one scale per row, or per group of a row: spans that end where the scale changes */
    const int64_t width = j->group > 0 && j->group < j->cols ? j->group : j->cols;
    for (int64_t i = lo; i < hi;) {
        int64_t r = i / j->cols, c = i - r * j->cols;
        int64_t end = r * j->cols + (c / width + 1) * width;
        end = end < (r + 1) * j->cols ? end : (r + 1) * j->cols;
        end = end < hi ? end : hi;
        fast_span(j, i, end, scale_of(j, i), 1, kind, dtype, out_kind, rounding);
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
/* codes by lookup: the table holds the rounding mode */
FAST(K_LUT, DT_F32, OUT_CODES, R_NEAREST_EVEN)
FAST(K_LUT, DT_BF16, OUT_CODES, R_NEAREST_EVEN)
static const range_fn LUT_FNS[2] = {ENTRY(K_LUT, DT_F32, OUT_CODES, R_NEAREST_EVEN),
                                    ENTRY(K_LUT, DT_BF16, OUT_CODES, R_NEAREST_EVEN)};

static range_fn pick(const job_t *j) {
    const fmt_t *f = j->fmt;
    if (f->nan_to_zero || j->scale_per_col || j->out_kind == OUT_VALUES) return run_range;
    if (f->rounding != R_NEAREST_EVEN && f->rounding != R_HALF_AWAY) return run_range;
    if (j->src_dtype != DT_F32 && j->src_dtype != DT_BF16) return run_range;
    if (j->out_kind == OUT_SAME && !j->scale) return run_range;
    if (j->out_kind == OUT_CODES && f->code_lut) return LUT_FNS[j->src_dtype == DT_BF16];
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

/* Quantize ``n`` elements: out_kind 0 = float32 grid values (quantize_values), 1 = fake-quantized
 * values in the source dtype (fake_quantize), 2 = uint8 codes (encode). ``group`` > 0 with
 * ``per_row``: one scale per ``group`` values of a row (job_t). */
void fp8ptq_quantize(const fmt_t *fmt, const void *src, int32_t src_dtype, void *dst,
                     int32_t out_kind, const float *scale, int32_t per_row, int32_t per_col,
                     const float *rand, int64_t n, int64_t cols, int64_t group,
                     int32_t nthreads) {
    job_t j = {src, src_dtype, dst, out_kind, scale, per_row, per_col, rand, n,
               cols > 0 ? cols : 1, fmt, group};
    parallel(&j, pick(&j), n, nthreads, 16);
}

/* One block of GPTQ's column loop (fp8ptq.algorithms.gptq.sweep._column_loop) in one call, on
 * the TRANSPOSED weight: ``w`` [b, rows] float32 (row i: weight column i of the block, updated
 * in place), ``u`` the block's [b, b] upper Cholesky factor of H^-1 (row stride ``ldu``),
 * ``s`` [b, rows] the scales, ``err`` [b, rows] out: each column's rounding error over its
 * pivot, ``codes`` [b, rows] out; ``values`` the format's 256 code values (decode), ``y`` a
 * [rows] scratch row. Per column, the torch loop's operations in its order, so the codes and
 * errors are the same bits: y = w / s; codes = encode(y) (this file's kernel for the format);
 * e = (w - values[code] * s) / pivot; every later column w_k += (-u_ik) * e as one-thread
 * ``addr_`` computes it (MKL's ``sger``): a fused multiply-add (one rounding) on each row's
 * first rows - rows % 16 values, a product then a sum on the rest (bit for bit on every size,
 * offset and row count probed; an x86 CPU with AVX2). Why: the loop issues ~10 small torch
 * ops per column, and their dispatch, not their arithmetic, was most of the sweep's time on
 * a CPU. Written once for the element type T of the sweep: ``FMA`` its fused multiply-add,
 * ``LANES`` the unit of the row prefix MKL's ``?ger`` fuses. */
#define GPTQ_BLOCK(NAME, T, FMA, LANES)                                                         \
    void NAME(const fmt_t *fmt, const T *values, T *w, const T *u, int64_t ldu, const T *s,     \
              T *err, uint8_t *codes, int64_t b, int64_t rows, float *y) {                      \
        job_t j = {y, DT_F32, NULL, OUT_CODES, NULL, 0, 0, NULL, rows, rows, fmt, 0};           \
        range_fn fn = pick(&j);                                                                 \
        const int64_t body = rows - rows % (LANES);                                             \
        for (int64_t i = 0; i < b; i++) {                                                       \
            T *wi = w + i * rows, *ei = err + i * rows;                                         \
            const T *si = s + i * rows;                                                         \
            uint8_t *ci = codes + i * rows;                                                     \
            for (int64_t r = 0; r < rows; r++) y[r] = (float)(wi[r] / si[r]);                   \
            j.dst = ci;                                                                         \
            fn(&j, 0, rows);                                                                    \
            const T pivot = u[i * ldu + i];                                                     \
            for (int64_t r = 0; r < rows; r++) ei[r] = (wi[r] - values[ci[r]] * si[r]) / pivot; \
            for (int64_t k = i + 1; k < b; k++) {                                               \
                const T uk = -u[i * ldu + k];                                                   \
                T *wk = w + k * rows;                                                           \
                int64_t r = 0;                                                                  \
                for (; r < body; r++) wk[r] = FMA(uk, ei[r], wk[r]);                            \
                for (; r < rows; r++) wk[r] = wk[r] + uk * ei[r];                               \
            }                                                                                   \
        }                                                                                       \
    }

GPTQ_BLOCK(fp8ptq_gptq_block, float, fmaf, 16)

/* The same block loop in float64 (``gptq_sweep_dtype`` float64, the CPU's default): ``w``,
 * ``u``, ``s``, ``err`` and ``values`` float64; y = (float)(w / s) is the codec's float32 input
 * (the torch loop's ``(w / s).float()``). One-thread ``addr_`` on float64 (MKL's ``dger``) fuses
 * the multiply-add on each row's first rows - rows % 8 values (probed as for ``sger``). */
GPTQ_BLOCK(fp8ptq_gptq_block64, double, fma, 8)
