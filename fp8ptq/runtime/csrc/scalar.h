/* One element at a time: the reference operations of fp8ptq/formats/codec.py for every
 * rounding mode (codec.c's general loop, and the tails of the 8-lane loops). */

#ifndef FP8PTQ_SCALAR_H
#define FP8PTQ_SCALAR_H

#include "common.h"


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

/* vec.h's vlut_codes for one value */
static inline uint8_t lut_code(const fmt_t *f, float y) {
    uint32_t u = f2u(y), key = u >> f->lut_shift;
    if (f->lut_sticky) key = key << 1 | ((u & ((1u << f->lut_shift) - 1u)) != 0);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint8_t)f->lut_nan[u >> 31] : f->code_lut[key];
}

static inline uint8_t code_of(const fmt_t *f, float q) {
    if (f->is_int) return (uint8_t)((int32_t)q & f->code_mask);
    return (uint8_t)float_code(f->step_log2, f->first_bits, f->first_rank, f->codes, q,
                               f->sign_bit, f->negzero, f->has_inf, f->inf_code, f->has_nan,
                               f->nan_code);
}

#endif
