#ifndef FP8PTQ_VEC_H
#define FP8PTQ_VEC_H

#include "common.h"

/* ---- 8-lane blocks for the hot cases: round half even / half away, saturating, float32 or
 * bfloat16 source, fake-quantized values or codes out. GCC/Clang vector extensions (AVX2 on
 * x86, NEON pairs on ARM; no intrinsics): the same IEEE operations as quantize_float,
 * quantize_int and code_of, lane by lane. IEEE-like formats compute their per-binade spacing
 * and codes arithmetically; HiFloat8's tapered grid rounds arithmetically too and reads its
 * codes with eight scalar loads per block (measured: AVX2's gather instruction, or permutes of
 * the 38 fields HiFloat8 uses in registers, are no faster on this AMD CPU). ---- */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));

enum { K_LINEAR = 0, K_TABLE = 1, K_INT = 2, K_LUT = 3 };

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

/* 1.0 where a magnitude of ``whole`` steps and ``frac`` of a step rounds up, else 0.0
 * (codec._round_up for half-even and half-away) */
VINLINE v8f vround_up(v8f whole, v8f frac, int rounding) {
    v8i up;
    if (rounding == R_NEAREST_EVEN) {
        v8f odd = whole - 2.0f * vfloor_pos(whole * 0.5f);
        up = (frac > 0.5f) | ((frac == 0.5f) & (odd == 1.0f));
    } else {
        up = frac >= 0.5f;
    }
    return (v8f)(up & (v8i)vsplatf(1.0f));
}

/* Sign, overflow, NaN and -0 of a rounded magnitude ``q`` (bits) of the source lane ``yb`` */
VINLINE v8f vfinish(const fmt_t *f, v8i q, v8u yb, v8u ab) {
    q = visel(q > (int32_t)f2u(f->max), vsplat((int32_t)f2u(f->overflow)), q);
    q = visel((v8i)ab > 0x7f800000, (v8i)(ab | 0x400000u), q);
    if (!f->negzero) return (v8f)((v8u)q | (yb & 0x80000000u & (v8u)(q != 0)));
    return (v8f)((v8u)q | (yb & 0x80000000u));
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
    return vfinish(f, visel(normal, (v8i)r, (v8i)sub), yb, ab);
}

/* vquantize for tapered grids (HiFloat8), rounded half away or half to even, in integer
 * operations like vquantize_rne_linear: within the format's binades the grid keeps w mantissa
 * bits, w from the lane's exponent by the taper thresholds (a variable shift per lane, no
 * lookup), so rounding adds half a step (minus one plus the kept lowest bit for half-even) and
 * clears the dropped bits; a carry into the next binade lands on its first grid point, a power
 * of two. Below the lowest binade the spacing is fixed and the lane takes the floor / fraction
 * form (exact: |y| / spacing < 2^23). Same values as the floor / fraction form for every
 * lane, bit for bit. */
VINLINE v8f vquantize_tapered(const fmt_t *f, v8f y, int rounding) {
    v8u yb = (v8u)y;
    v8u ab = yb & 0x7fffffffu;
    v8i e = (v8i)(ab >> 23) - 127;
    v8i ec = visel(e > f->taper_hi, vsplat(f->taper_hi), e);
    v8i a = visel(ec < 0, -ec, ec);
    v8i w = vsplat(f->taper_w0) + (a >= f->taper_t[0]) + (a >= f->taper_t[1]) +
            (a >= f->taper_t[2]) + (a >= f->taper_t[3]);  /* true lanes are -1 */
    v8u drop = (v8u)(23 - w);
    v8u half = (v8u){0} + (1u << 22) >> (23 - drop);  /* 2^(drop - 1): drop is 23 - w >= 1 */
    v8u keep = ~(((v8u){0} + 1u << drop) - 1u);
    v8u r;
    if (rounding == R_NEAREST_EVEN) {
        /* the kept significand's lowest bit; with no mantissa bits the implicit 1: odd */
        v8u odd = (v8u)visel(w == 0, vsplat(1), (v8i)((ab >> drop) & 1u));
        r = (ab + half - 1u + odd) & keep;
    } else {
        r = (ab + half) & keep;
    }
    /* below the lowest binade: a fixed spacing 2^slo, slo = the lowest binade's step */
    const int32_t slo = f->step_log2[0];
    v8f t = (v8f)ab * pow2(-slo);
    v8f whole = vfloor_pos(t);
    v8i sub = (v8i)((whole + vround_up(whole, t - whole, rounding)) * pow2(slo));
    return vfinish(f, visel(e < f->taper_lo, sub, (v8i)r), yb, ab);
}

VINLINE v8f vquantize(const fmt_t *f, v8f y, int kind, int rounding) {
    if (kind == K_LINEAR && rounding == R_NEAREST_EVEN) return vquantize_rne_linear(f, y);
    if (kind == K_TABLE && f->tapered) return vquantize_tapered(f, y, rounding);
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
    v8f q = (whole + vround_up(whole, t - whole, rounding)) * vpow2(sl);
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
    if (f->has_inf) code = visel(~finite & ~nan, vsplat(f->inf_code) | (-sign & f->sign_bit), code);
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

/* Codes by lookup (``fmt_t.code_lut``) of 8 lanes of float32 bits ``u``: eight byte loads
 * from the table (no arithmetic rounding, no code formula), NaN lanes blended in after. */
VINLINE v8b vlut_codes(const fmt_t *f, v8u u) {
    v8u key = u >> f->lut_shift;
    if (f->lut_sticky)
        key = (key << 1) | ((v8u)((u & ((1u << f->lut_shift) - 1u)) != 0) & 1u);
    uint64_t c = 0;
    for (int l = 0; l < 8; l++) c |= (uint64_t)f->code_lut[key[l]] << (8 * l);
    v8b nan = narrow8((v8i)(u & 0x7fffffffu) > 0x7f800000);
    v8b nan_code = narrow8(visel((v8i)u < 0, vsplat(f->lut_nan[1]), vsplat(f->lut_nan[0])));
    uint64_t m, nc;
    memcpy(&m, &nan, sizeof m);
    memcpy(&nc, &nan_code, sizeof nc);
    c = (c & ~m) | (nc & m);
    v8b out;
    memcpy(&out, &c, sizeof out);
    return out;
}

#endif
