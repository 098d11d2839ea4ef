#include "common.h"

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
