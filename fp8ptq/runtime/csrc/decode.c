#include "common.h"

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