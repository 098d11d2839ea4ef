"""HiFloat8 (Luo et al. 2024): code table, tapered precision, and its rounding modes.

The decode table is checked against an independent bit-string parser of the paper's Tables 1-3
and the typical values of Table 4. Rounding is checked against brute-force references (nearest
value, ties away from zero) and bit-level references of the simplified stochastic rounding
(SR14 for fp32 sources, SR2 for fp16 / bf16 sources) on exhaustive or large random inputs.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ptq.formats import decode, encode, fake_quantize, get_format, quantize_values

HIF8 = get_format("hif8")
MAX = 2.0**15
INF_MAG = 1.5 * 2.0**15  # the magnitude whose two bit patterns are +-inf
CODES_T = torch.arange(256, dtype=torch.uint8)
VALUES = decode(CODES_T, HIF8, torch.float64)
FINITE = VALUES[torch.isfinite(VALUES)]
POS = np.array(sorted({abs(v) for v in FINITE.tolist()}), dtype=np.float64)  # 0 first
# the rounding grid seen from |x|: every magnitude plus the inf slot as the next point past max
GRID = np.append(POS, INF_MAG)

FLOATS32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
HIF8_RANGE = st.floats(min_value=-2.0**16, max_value=2.0**16, width=32, allow_nan=False)
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True)


def mant_bits(e: int) -> int:
    """Luo et al. 2024 Table 3: mantissa width at exponent e (0 for the denormals)."""
    if e < -15:
        return 0
    return 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1


def paper_decode(code: int) -> float:
    """Luo et al. 2024 Tables 2-3 and eqs. (1)-(2), parsed from the bit string."""
    sign = -1.0 if code & 0x80 else 1.0
    bits = f"{code & 0x7F:07b}"
    for prefix, d in (("11", 4), ("10", 3), ("01", 2), ("001", 1), ("0001", 0),  # noqa: B007
                      ("0000", None)):  # d is read after the loop
        if bits.startswith(prefix):
            rest = bits[len(prefix):]
            break
    if d is None:  # DML: X = (-1)^S * 2^(M - 23); M = 0 is zero (S=0) / NaN (S=1)
        m = int(rest, 2)
        assert len(rest) == 3
        if m == 0:
            return 0.0 if sign > 0 else math.nan
        return sign * 2.0 ** (m - 23)
    em, mant = rest[:d], rest[d:]
    assert len(mant) == {0: 3, 1: 3, 2: 3, 3: 2, 4: 1}[d]  # Table 3 mantissa widths
    if d == 0:
        e = 0
    else:  # sign-magnitude exponent with a hidden leading 1 in the magnitude
        e = (-1 if em[0] == "1" else 1) * int("1" + em[1:], 2)
    v = 2.0**e * (1 + int(mant, 2) / 2 ** len(mant))
    if v == INF_MAG:
        return sign * math.inf
    return sign * v


def q(x, **kw) -> torch.Tensor:
    return quantize_values(torch.as_tensor(x, dtype=torch.float32), HIF8, **kw)


def ref_nearest_away(x: np.ndarray, saturate: bool = True) -> np.ndarray:
    """Brute force: nearest grid value to float64(x), ties away from zero."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    lo_i = np.clip(np.searchsorted(GRID, a, side="right") - 1, 0, len(GRID) - 2)
    lo, hi = GRID[lo_i], GRID[lo_i + 1]
    r = np.where(2 * a >= lo + hi, hi, lo)  # exact in float64
    r = np.where(a >= INF_MAG, INF_MAG, r)
    r = np.where(r > MAX, MAX if saturate else np.inf, r)
    return np.copysign(r, x) + 0.0  # no -0 in hif8


# ------------------------------------------------------------------------------------------------
# the code table


def test_decode_equals_paper_tables():
    for code in range(256):
        ours = VALUES[code].item()
        ref = paper_decode(code)
        if math.isnan(ref):
            assert math.isnan(ours), hex(code)
        else:
            assert ours == ref, (hex(code), ours, ref)


def test_table4_typical_values():
    v = {c: VALUES[c].item() for c in range(256)}
    assert v[0x6F] == math.inf and v[0xEF] == -math.inf  # S1101111
    assert math.isnan(v[0x80])  # 10000000
    assert v[0x00] == 0.0 and math.copysign(1, v[0x00]) == 1
    assert v[0x6E] == 2.0**15  # max positive normal
    assert v[0x7E] == 2.0**-15  # min positive normal
    assert v[0x07] == 2.0**-16  # max positive denormal
    assert v[0x01] == 2.0**-22  # min positive denormal
    assert [c for c in range(256) if math.isnan(v[c])] == [0x80]
    assert [c for c in range(256) if math.isinf(v[c])] == [0x6F, 0xEF]
    assert [c for c in range(256) if v[c] == 0] == [0x00]  # exactly one zero


def test_spec_facts():
    assert HIF8.max == 2.0**15
    assert HIF8.min_normal == 2.0**-15
    assert HIF8.min_subnormal == 2.0**-22
    assert HIF8.has_inf and HIF8.has_nan and not HIF8.has_negative_zero
    assert HIF8.binades == 38  # [-22, 15]
    assert HIF8.layout.nan_code == 0x80 and HIF8.layout.inf_code == 0x6F
    assert HIF8.rounding == "half_away"
    assert HIF8.torch_dtype is None
    d = HIF8.describe()
    assert d["max"] == 32768 and d["binades"] == 38 and d["has_negative_zero"] is False


def test_no_redundancy():
    finite_nonzero = [x for x in VALUES.tolist() if math.isfinite(x) and x != 0]
    # 256 codes = 1 zero + 1 NaN + 2 inf + 252 distinct finite non-zero values
    assert len(finite_nonzero) == 252 == len(set(finite_nonzero))
    assert len({x for x in VALUES.tolist() if not math.isnan(x)}) == 255  # + zero, +-inf
    # symmetric: code | 0x80 is the negation (zero / NaN aside)
    for c in range(1, 128):
        assert VALUES[c | 0x80].item() == -VALUES[c].item()


def test_exponent_range_and_tapered_precision():
    pos = [x for x in VALUES.tolist() if math.isfinite(x) and x > 0]
    per_binade = collections.Counter(math.frexp(x)[1] - 1 for x in pos)
    assert min(per_binade) == -22 and max(per_binade) == 15
    assert sorted(per_binade) == list(range(-22, 16))  # 38 binades, none missing
    for e, n in per_binade.items():
        expect = 2 ** mant_bits(e)
        if e == 15:
            expect -= 1  # 1.5 x 2^15 is inf
        assert n == expect, (e, n)
    # abstract: 7 exponents with 3-bit, 8 with 2-bit, 16 with 1-bit mantissa; 7 denormal binades
    widths = collections.Counter(mant_bits(e) for e in range(-22, 16))
    assert widths == {3: 7, 2: 8, 1: 16, 0: 7}
    # within each binade the values are evenly spaced 2^(e - m)
    for e in range(-22, 16):
        vals = sorted(x for x in pos if math.frexp(x)[1] - 1 == e)
        step = 2.0 ** (e - mant_bits(e))
        assert vals == [2.0**e + k * step for k in range(len(vals))]


def test_every_value_round_trips():
    codes = CODES_T[torch.isfinite(VALUES) | torch.isinf(VALUES)]
    vals = VALUES[codes.long()].float()
    assert torch.equal(encode(vals, HIF8, saturate=False), codes)
    assert torch.equal(q(vals, saturate=False), vals)
    for rounding in ("half_away", "nearest_even", "hybrid", "stochastic"):
        fin = vals[torch.isfinite(vals)]
        assert torch.equal(q(fin, rounding=rounding), fin), rounding
        assert torch.equal(q(fin.bfloat16(), rounding=rounding), fin), rounding
        assert torch.equal(q(fin.half(), rounding=rounding), fin), rounding
    # the negative-zero input has no code of its own
    assert encode(torch.tensor([-0.0, 0.0]), HIF8).tolist() == [0, 0]
    assert not torch.signbit(q([-0.0, -1e-30])).any()


# ------------------------------------------------------------------------------------------------
# round half away (the default), saturation, NaN


def test_half_away_matches_brute_force_on_random_and_edge_inputs():
    rng = np.random.default_rng(0)
    n = 1 << 18
    mids = (GRID[:-1] + GRID[1:]) / 2
    edges = np.concatenate([GRID, mids]).astype(np.float32)
    x = np.concatenate([
        edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(0)),
        (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-26, 18, n)).astype(np.float32),
        rng.integers(0, 2**31, n // 4, dtype=np.uint64).astype(np.uint32).view(np.float32),
    ])
    x = np.concatenate([x, -x])
    x = x[np.isfinite(x)]
    for saturate in (True, False):
        got = q(x, saturate=saturate).numpy().astype(np.float64)
        ref = ref_nearest_away(x, saturate)
        bad = np.nonzero(got != ref)[0]
        assert bad.size == 0, [(x[i], got[i], ref[i]) for i in bad[:5]]
    # the codes agree with the values
    codes = encode(torch.from_numpy(x), HIF8)
    assert torch.equal(decode(codes, HIF8), q(x))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ties_away_from_zero(sign):
    mids = ((POS[:-1] + POS[1:]) / 2).astype(np.float32)  # exact in float32
    assert np.array_equal(mids.astype(np.float64), (POS[:-1] + POS[1:]) / 2)
    got = q(sign * mids).numpy().astype(np.float64)
    assert np.array_equal(got, sign * POS[1:])
    # just below a midpoint goes to the smaller magnitude
    below = np.nextafter(mids, np.float32(0))
    assert np.array_equal(q(sign * below).numpy().astype(np.float64) + 0.0,
                          sign * POS[:-1] + 0.0)
    # round-half-even, on request, picks the even grid point instead at e.g. 1 + 1/16
    assert q(sign * np.float32([1 + 1 / 16]), rounding="nearest_even").item() == sign * 1.0
    assert q(sign * np.float32([1 + 1 / 16])).item() == sign * (1 + 1 / 8)


def test_saturation():
    t = 1.25 * 2.0**15  # midpoint of 2^15 and the inf slot
    below = float(np.nextafter(np.float32(t), np.float32(0)))
    x = [t, -t, below, -below, 2.0**16, -1e30, math.inf, -math.inf]
    assert q(x, saturate=False).tolist() == [math.inf, -math.inf, MAX, -MAX, math.inf,
                                             -math.inf, math.inf, -math.inf]
    assert q(x).tolist() == [MAX, -MAX, MAX, -MAX, MAX, -MAX, MAX, -MAX]
    assert encode(torch.tensor(x), HIF8, saturate=False).tolist() == [
        0x6F, 0xEF, 0x6E, 0xEE, 0x6F, 0xEF, 0x6F, 0xEF]
    assert encode(torch.tensor(x), HIF8).tolist() == [0x6E, 0xEE] * 4


def test_underflow():
    tiny = 2.0**-22
    x = np.float32([tiny / 2, np.nextafter(np.float32(tiny / 2), np.float32(0)), 1e-30, 1e-45])
    assert q(x).tolist() == [tiny, 0.0, 0.0, 0.0]  # tie at 2^-23 goes away from zero
    assert q(-x).tolist() == [-tiny, 0.0, 0.0, 0.0]
    assert encode(torch.from_numpy(-x), HIF8).tolist() == [0x81, 0, 0, 0]


def test_nan_handling():
    x = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 1.0])
    assert encode(x, HIF8).tolist() == [0x80, 0x80, 0x6E, 0xEE, 0x08]
    assert encode(x, HIF8, saturate=False).tolist() == [0x80, 0x80, 0x6F, 0xEF, 0x08]
    out = q(x, nan_to_zero=True, saturate=False)
    assert out.tolist() == [0.0, 0.0, math.inf, -math.inf, 1.0]
    assert encode(x, HIF8, nan_to_zero=True, saturate=False).tolist() == [
        0, 0, 0x6F, 0xEF, 0x08]
    assert q(x, nan_to_zero=True).tolist() == [0.0, 0.0, MAX, -MAX, 1.0]
    out = q(x)
    assert torch.isnan(out[:2]).all()


@SETTINGS
@given(HIF8_RANGE)
def test_property_nearest(x):
    y = q([x]).item()
    a = abs(x)
    i = int(np.clip(np.searchsorted(GRID, a, side="right") - 1, 0, len(GRID) - 2))
    lo, hi = GRID[i], GRID[i + 1]
    if a >= 1.25 * 2.0**15:
        assert y == math.copysign(MAX, x)
        return
    assert abs(y) in (lo, hi)
    assert abs(abs(y) - a) <= (hi - lo) / 2
    if abs(y) == lo and lo != hi:
        assert a - lo < (hi - lo) / 2  # only strictly-nearer goes down (ties go away)
    assert y == 0 or math.copysign(1, y) == math.copysign(1, x)


@SETTINGS
@given(HIF8_RANGE, HIF8_RANGE)
def test_property_monotonic(x, y):
    x, y = min(x, y), max(x, y)
    qx, qy = q([x, y]).tolist()
    assert qx <= qy
    qx, qy = q([x, y], saturate=False).tolist()
    assert qx <= qy


def test_monotonic_dense():
    rng = np.random.default_rng(1)
    x = np.sort(np.concatenate([
        (rng.uniform(-1, 1, 1 << 18) * 2.0 ** rng.integers(-25, 17, 1 << 18)).astype(np.float32),
        GRID.astype(np.float32), -GRID.astype(np.float32)]))
    for saturate in (True, False):
        y = q(x, saturate=saturate)
        assert (y[1:] >= y[:-1]).all()


@SETTINGS
@given(FLOATS32)
def test_property_decode_encode_is_quantize(x):
    xt = torch.tensor([x], dtype=torch.float32)
    v = q(xt)
    assert torch.equal(decode(encode(xt, HIF8), HIF8), v)
    assert v.item() in set(VALUES.tolist())  # a representable value
    assert torch.equal(q(v), v)  # idempotent


# ------------------------------------------------------------------------------------------------
# hybrid rounding (Luo et al. 2024 eq. 3): TA where |E| < 4, simplified SR (SR14 / SR2) elsewhere


def _bitlevel_hybrid(x: np.ndarray, src_mbits: int, src_bias: int, sr_bits: int) -> np.ndarray:
    """Reference from the bit fields of a normal source value with E in [-22, 15]."""
    uint = {7: np.uint16, 10: np.uint16, 23: np.uint32}[src_mbits]
    bits = x.view(uint).astype(np.int64)
    ebits = 8 if src_mbits != 10 else 5
    m = bits & ((1 << src_mbits) - 1)
    e = ((bits >> src_mbits) & ((1 << ebits) - 1)) - src_bias
    sign = np.where(bits >> (src_mbits + ebits) & 1, -1.0, 1.0)
    k = np.array([mant_bits(int(v)) for v in e.ravel()]).reshape(e.shape)
    d = src_mbits - k  # discarded bits
    kept = ((1 << src_mbits) | m) >> d
    disc = m & ((1 << d) - 1)
    ta_up = (disc >> (d - 1)) & 1
    if sr_bits == 14:
        f, t = disc >> (d - 14), bits & 0x3FFF
        sr_up = (disc != 0) & (f >= t)
    else:  # SR2: F2 = 2 MSBs of the discarded bits, T2 = {source LSB, 1}
        f, t = disc >> (d - 2), ((bits & 1) << 1) | 1
        sr_up = f >= t
    up = np.where(np.abs(e) < 4, ta_up, sr_up)
    mag = (kept + up).astype(np.float64) * np.exp2((e - k).astype(np.float64))
    return sign * np.minimum(mag, MAX)  # saturating


def _normal_in_range(x_f32: np.ndarray, lo=-22, hi=15) -> np.ndarray:
    e = np.frexp(np.where(np.isfinite(x_f32), x_f32, 0).astype(np.float64))[1] - 1
    return np.isfinite(x_f32) & (x_f32 != 0) & (e >= lo) & (e <= hi)


def test_hybrid_sr14_fp32_bit_exact():
    rng = np.random.default_rng(2)
    n = 1 << 19
    bits = rng.integers(0, 2**23, n, dtype=np.int64)
    e = rng.integers(-22, 16, n)
    s = rng.integers(0, 2, n)
    x = ((s << 31) | ((e + 127) << 23) | bits).astype(np.uint32).view(np.float32)
    got = q(x, rounding="hybrid").numpy().astype(np.float64)
    ref = _bitlevel_hybrid(x, 23, 127, 14)
    bad = np.nonzero(got != ref)[0]
    assert bad.size == 0, [(x[i], got[i], ref[i]) for i in bad[:5]]


@pytest.mark.parametrize("dtype,mbits,bias", [(torch.bfloat16, 7, 127), (torch.float16, 10, 15)])
def test_hybrid_sr2_exhaustive_16bit(dtype, mbits, bias):
    """Every fp16 / bf16 bit pattern that is a normal number with exponent in [-22, 15]."""
    pat = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    xt = torch.from_numpy(pat.view(np.int16)).view(dtype)
    x32 = xt.float().numpy()
    sub = ((pat >> mbits) & ((1 << (15 - mbits)) - 1)) == 0
    sel = _normal_in_range(x32) & ~sub
    assert sel.sum() > 8000
    got = quantize_values(xt, HIF8, rounding="hybrid").numpy().astype(np.float64)
    ref = _bitlevel_hybrid(pat[sel], mbits, bias, 2)
    bad = np.nonzero(got[sel] != ref)[0]
    assert bad.size == 0, [(x32[sel][i], got[sel][i], ref[i]) for i in bad[:5]]
    # outside the bit-level reference (tiny, subnormal, huge): still one of the two neighbours
    rest = np.isfinite(x32) & ~sel
    a = np.abs(x32[rest]).astype(np.float64)
    i = np.clip(np.searchsorted(GRID, a, side="right") - 1, 0, len(GRID) - 2)
    r = np.abs(got[rest])
    assert np.all((r == GRID[i]) | (r == np.minimum(GRID[i + 1], MAX)) | (a > MAX))


def test_hybrid_is_half_away_below_exponent_4():
    rng = np.random.default_rng(3)
    x = (rng.uniform(1, 2, 1 << 18) * 2.0 ** rng.integers(-3, 4, 1 << 18)).astype(np.float32)
    x *= rng.choice([-1, 1], x.shape).astype(np.float32)
    mids = ((POS[:-1] + POS[1:]) / 2).astype(np.float32)
    mids = mids[(mids >= 2.0**-3) & (mids < 2.0**4)]
    x = np.concatenate([x, mids, -mids])
    for src in (torch.from_numpy(x), torch.from_numpy(x).bfloat16(), torch.from_numpy(x).half()):
        assert torch.equal(quantize_values(src, HIF8, rounding="hybrid"),
                           quantize_values(src, HIF8, rounding="half_away"))


def test_hybrid_large_exponents_give_a_neighbour_and_keep_representables():
    rng = np.random.default_rng(4)
    n = 1 << 18
    e = rng.choice(np.r_[-30:-3, 4:17], n)
    x = (rng.uniform(1, 2, n) * 2.0**e * rng.choice([-1, 1], n)).astype(np.float32)
    got = np.abs(q(x, rounding="hybrid", saturate=False).numpy().astype(np.float64))
    a = np.abs(x).astype(np.float64)
    i = np.clip(np.searchsorted(GRID, a, side="right") - 1, 0, len(GRID) - 2)
    hi = np.where(GRID[i + 1] > MAX, np.inf, GRID[i + 1])
    ok = (got == GRID[i]) | (got == hi) | ((a >= INF_MAG) & (got == np.inf))
    assert ok.all(), [(x[j], got[j]) for j in np.nonzero(~ok)[0][:5]]
    rep = torch.from_numpy(POS.astype(np.float32))
    assert torch.equal(q(rep, rounding="hybrid"), rep)
    assert torch.equal(q(-rep, rounding="hybrid"), -rep + 0.0)


def test_hybrid_sr14_is_deterministic():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1 << 16, generator=g) * 1000
    state = torch.get_rng_state()
    a = q(x, rounding="hybrid")
    b = q(x, rounding="hybrid")
    assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), state)  # uses no random numbers
    # same input bits -> same output wherever they sit
    perm = torch.randperm(x.numel(), generator=g)
    assert torch.equal(q(x[perm], rounding="hybrid"), a[perm])
    rep = x[:1].repeat(1000)
    assert (q(rep, rounding="hybrid") == a[0]).all()


def _systematic_inputs(e: int, frac: float, n: int, dtype=torch.float32, seed=0):
    """Inputs in binade e whose fraction of an ulp is ``frac`` +- 1%, random low bits."""
    g = torch.Generator().manual_seed(seed)
    k = mant_bits(e)
    ulp = 2.0 ** (e - k)
    whole = torch.randint(2**k, 2 ** (k + 1), (n,), generator=g).double()
    u = frac + 0.02 * (torch.rand(n, generator=g, dtype=torch.float64) - 0.5)
    sign = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return (sign * (whole + u) * ulp).to(dtype), ulp


@pytest.mark.parametrize("e", [4, 6, 9, 14, -5, -9, -15, -18])
def test_hybrid_sr14_has_small_mean_error(e):
    x, ulp = _systematic_inputs(e, 0.3, 100_000, seed=e + 100)
    xd = x.double()
    err_ta = ((q(x, rounding="half_away").double().abs() - xd.abs()) / ulp).mean().item()
    up_sr = ((q(x, rounding="hybrid").double().abs() - xd.abs()) / ulp)
    err_sr = up_sr.mean().item()
    assert abs(err_ta + 0.3) < 0.01  # TA always rounds down: -0.3 ulp
    assert abs(err_sr) < 0.03  # SR14 rounds up ~30% of the time
    frac_up = (up_sr > 0).double().mean().item()
    assert 0.25 < frac_up < 0.35


def test_hybrid_sr2_bf16_mean_error():
    """SR2: thresholds 0.25 / 0.75 chosen by the source LSB. For a fraction of ~0.6 ulp TA always
    rounds up (+0.4 ulp); SR2 rounds up only where F2 >= T2."""
    x, ulp = _systematic_inputs(9, 0.6, 50_000, dtype=torch.bfloat16, seed=1)
    xd = x.double()
    ta = ((quantize_values(x, HIF8, rounding="half_away").double().abs() - xd.abs()) / ulp)
    hr = ((quantize_values(x, HIF8, rounding="hybrid").double().abs() - xd.abs()) / ulp)
    assert (ta > 0).all()
    # F2 = 2 (0.5 <= f < 0.75): up iff LSB == 0 (T2 = 1), so about half go up
    lsb = x.view(torch.int16) & 1
    assert torch.equal(hr > 0, lsb == 0)
    assert abs(hr.mean().item()) < abs(ta.mean().item())


# ------------------------------------------------------------------------------------------------
# stochastic rounding with a generator


def test_stochastic_reproducible_and_unbiased():
    x = torch.full((100_000,), 1000.3)  # binade 9: grid 768, 1024 (1-bit mantissa, step 256)
    a = q(x, rounding="stochastic", generator=torch.Generator().manual_seed(42))
    b = q(x, rounding="stochastic", generator=torch.Generator().manual_seed(42))
    c = q(x, rounding="stochastic", generator=torch.Generator().manual_seed(43))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert set(a.unique().tolist()) == {768.0, 1024.0}
    step = 256.0
    p = (1000.3 - 768) / step
    sigma = step * math.sqrt(p * (1 - p) / x.numel())
    assert abs(a.double().mean().item() - 1000.300048828125) < 5 * sigma
    # negative inputs mirror
    d = q(-x, rounding="stochastic", generator=torch.Generator().manual_seed(42))
    assert torch.equal(d, -a)


@pytest.mark.parametrize("value", [0.3, 3.3, 77.7, 1e-6, 12345.0])
def test_stochastic_unbiased_various(value):
    n = 100_000
    x = torch.full((n,), value)
    y = q(x, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    xv = x[0].double().item()
    i = int(np.searchsorted(GRID, xv, side="right") - 1)
    lo, hi = GRID[i], GRID[i + 1]
    assert set(y.double().unique().tolist()) <= {lo, hi}
    p = (xv - lo) / (hi - lo)
    sigma = (hi - lo) * math.sqrt(max(p * (1 - p), 1e-12) / n)
    assert abs(y.double().mean().item() - xv) < 5 * sigma + 1e-12


def test_fake_quantize_hif8_default_rounding_is_half_away():
    x = torch.tensor([1 + 1 / 16, -(1 + 1 / 16), 3.0, 1000.0])
    assert torch.equal(fake_quantize(x, 1.0, HIF8), q(x, rounding="half_away"))
    assert torch.equal(fake_quantize(x, 2.0, HIF8), q(x / 2, rounding="half_away") * 2)
