"""Bit-exact checks of the IEEE-like FP8 formats against ml_dtypes and torch's float8 dtypes.

Every code is decoded; every code value, every midpoint between neighbours (ties), the floats
just either side of each midpoint, overflow, underflow, signed zeros, infinities and NaN are
encoded and compared code-for-code with ``ml_dtypes`` (and torch where it has the dtype). A few
million random float32 (scaled normals and raw bit patterns) close the gaps.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8ptq.formats import (
    codec,
    codes_as_torch_float8,
    decode,
    encode,
    fake_quantize,
    get_format,
    quantize_values,
    to_torch_float8,
    torch_dtype,
)

# name -> (ml_dtypes dtype, torch dtype or None, canonical NaN code we must write)
FORMATS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, 0x7F),
    "e5m2": (ml_dtypes.float8_e5m2, torch.float8_e5m2, 0x7E),
    "e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, torch.float8_e4m3fnuz, 0x80),
    "e5m2fnuz": (ml_dtypes.float8_e5m2fnuz, torch.float8_e5m2fnuz, 0x80),
    "e4m3b11fnuz": (ml_dtypes.float8_e4m3b11fnuz, None, 0x80),
    # generic IEEE-style ExMy names (inf + several NaNs): ml_dtypes float8_e3m4 / float8_e4m3
    "e3m4": (ml_dtypes.float8_e3m4, None, 0x78),
    "e4m3b7": (ml_dtypes.float8_e4m3, None, 0x7C),
}
NAMES = list(FORMATS)
TORCH_NAMES = [n for n in NAMES if FORMATS[n][1] is not None]
ALL_CODES = np.arange(256, dtype=np.uint8)
EXPECTED_MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e4m3fnuz": 240.0, "e5m2fnuz": 57344.0,
                "e4m3b11fnuz": 30.0, "e3m4": 15.5, "e4m3b7": 240.0}


def ref_values(name) -> np.ndarray:
    """float64 value of every code according to ml_dtypes."""
    return ALL_CODES.view(FORMATS[name][0]).astype(np.float64)


def finite_values(name) -> np.ndarray:
    """Sorted distinct finite magnitudes (+0 first) according to ml_dtypes."""
    v = ref_values(name)
    return np.unique(np.abs(v[np.isfinite(v)]))


def ml_encode(x: np.ndarray, name) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(FORMATS[name][0]).view(np.uint8)


def our_encode(x: np.ndarray, name, **kw) -> np.ndarray:
    return encode(torch.from_numpy(np.asarray(x, dtype=np.float32)), get_format(name),
                  **kw).numpy()


def assert_codes_equal(ours: np.ndarray, ref: np.ndarray, name, x=None):
    """Codes equal, except that where the reference is a NaN code we require *our* canonical NaN
    code (ml_dtypes keeps the input's NaN sign, e.g. 0xFF for -nan in e4m3)."""
    dt, _, nan_code = FORMATS[name]
    ref_nan = np.isnan(ref.view(dt).astype(np.float32))
    ours_nan = np.isnan(ours.view(dt).astype(np.float32))
    bad = np.nonzero(ref_nan != ours_nan)[0]
    assert bad.size == 0, _report(name, "NaN-ness", bad, ours, ref, x)
    assert np.all(ours[ours_nan] == nan_code), _report(
        name, "non-canonical NaN code", np.nonzero(ours_nan & (ours != nan_code))[0], ours, ref, x)
    bad = np.nonzero(~ref_nan & (ours != ref))[0]
    assert bad.size == 0, _report(name, "code", bad, ours, ref, x)


def _report(name, what, bad, ours, ref, x):
    rows = [f"x={x[i]!r} ours=0x{ours[i]:02X} ref=0x{ref[i]:02X}" if x is not None else
            f"i={i} ours=0x{ours[i]:02X} ref=0x{ref[i]:02X}" for i in bad[:8]]
    return f"{name}: {bad.size} mismatches ({what}): " + "; ".join(rows)


def midpoints_and_neighbours(name) -> np.ndarray:
    """Every code value (both signs), every midpoint between neighbouring finite values, the
    float32 just above and below each midpoint, and the same past the largest finite value."""
    pos = finite_values(name)
    mids = (pos[:-1] + pos[1:]) / 2
    # past max: half a top-binade step above max (the overflow threshold) and a few beyond
    top = pos[-1]
    ulp_top = pos[-1] - pos[-2]
    beyond = np.array([top + ulp_top / 2, top + ulp_top, 2 * top, 1e30, 3.0e38])
    # below the smallest non-zero: half of it is a tie with 0, a quarter rounds to 0
    tiny = pos[1]
    small = np.array([tiny / 2, tiny / 4, tiny / 1024, 1e-40, 1e-45])
    pts = np.concatenate([pos, mids, beyond, small]).astype(np.float32)
    assert np.array_equal(pts[: len(pos) + len(mids)].astype(np.float64),
                          np.concatenate([pos, mids]))  # midpoints are exact in float32
    up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(0))
    allp = np.concatenate([pts, up, down])
    return np.concatenate([allp, -allp]).astype(np.float32)


SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan], dtype=np.float32)


# ------------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("name", NAMES)
def test_decode_all_codes_equals_ml_dtypes(name):
    ref = ref_values(name)
    ours = decode(torch.arange(256, dtype=torch.uint8), get_format(name), torch.float64).numpy()
    assert np.array_equal(np.isnan(ref), np.isnan(ours)), "NaN positions differ"
    fin = ~np.isnan(ref)
    assert np.array_equal(ref[fin], ours[fin])
    # signed zeros (and every other non-NaN sign) by signbit
    assert np.array_equal(np.signbit(ref[fin]), np.signbit(ours[fin]))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_decode_dtype_and_shape(name, dtype):
    codes = torch.arange(256, dtype=torch.uint8).reshape(4, 8, 8)
    out = decode(codes, get_format(name), dtype=dtype)
    assert out.dtype == dtype and out.shape == (4, 8, 8)
    ref = torch.from_numpy(ref_values(name)).reshape(4, 8, 8).to(dtype)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out.nan_to_num(0.0), ref.nan_to_num(0.0))


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_decode_equals_torch_view(name):
    spec = get_format(name)
    assert torch_dtype(spec) is FORMATS[name][1]
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(FORMATS[name][1]).to(torch.float64)
    ours = decode(codes, spec, torch.float64)
    assert torch.equal(torch.isnan(ref), torch.isnan(ours))
    fin = ~torch.isnan(ref)
    assert torch.equal(ref[fin], ours[fin])
    assert torch.equal(torch.signbit(ref[fin]), torch.signbit(ours[fin]))
    # the same through codes_as_torch_float8 (a view: no copy)
    view = codes_as_torch_float8(codes, spec)
    assert view.dtype == FORMATS[name][1]
    assert view.data_ptr() == codes.data_ptr()
    back = view.to(torch.float64)
    assert torch.equal(back[fin], ours[fin]) and torch.isnan(back[~fin]).all()


@pytest.mark.parametrize("name", NAMES)
def test_range_facts(name):
    spec = get_format(name)
    pos = finite_values(name)[1:]
    assert spec.max == EXPECTED_MAX[name] == pos[-1]
    assert spec.min_subnormal == pos[0]
    assert spec.min_normal == 2.0 ** (1 - spec.bias)
    assert spec.has_inf == bool(np.isinf(ref_values(name)).any())
    assert spec.has_nan
    assert spec.has_negative_zero == any(z == 0 and np.signbit(z) for z in ref_values(name))
    assert spec.layout.nan_code == FORMATS[name][2]


@pytest.mark.parametrize("name", NAMES)
def test_canonical_nan_code(name):
    spec = get_format(name)
    code = FORMATS[name][2]
    assert math.isnan(decode(torch.tensor([code], dtype=torch.uint8), spec).item())
    got = our_encode(np.array([np.nan, -np.nan, np.float32(np.nan) * 0], np.float32), name,
                     saturate=False)
    assert got.tolist() == [code] * 3
    got = our_encode(np.array([np.nan, -np.nan], np.float32), name)  # saturating too
    assert got.tolist() == [code] * 2
    # NaN with payloads / sign via raw bit patterns
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF], np.uint32)
    got = our_encode(bits.view(np.float32), name)
    assert got.tolist() == [code] * 5


# ------------------------------------------------------------------------------------------------
# encode, saturate=False: must equal ml_dtypes' astype exactly


@pytest.mark.parametrize("name", NAMES)
def test_encode_every_code_value(name):
    ref = ref_values(name).astype(np.float32)
    x = np.concatenate([ref, -ref])
    assert_codes_equal(our_encode(x, name, saturate=False), ml_encode(x, name), name, x)
    # each finite non-NaN code maps back to itself (the one zero of fnuz aside)
    spec = get_format(name)
    codes = our_encode(ref, name, saturate=False)
    keep = np.isfinite(ref) | np.isinf(ref)
    keep &= ~np.isnan(ref)
    if not spec.has_negative_zero:
        keep &= ref != 0
    assert np.array_equal(codes[keep], ALL_CODES[keep])


@pytest.mark.parametrize("name", NAMES)
def test_encode_midpoints_ties_and_neighbours(name):
    x = midpoints_and_neighbours(name)
    assert_codes_equal(our_encode(x, name, saturate=False), ml_encode(x, name), name, x)


@pytest.mark.parametrize("name", NAMES)
def test_ties_round_half_to_even(name):
    """Explicitly: every midpoint goes to the neighbour with an even mantissa (code LSB 0)."""
    spec = get_format(name)
    pos = finite_values(name)
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    codes = our_encode(mids, name, saturate=False)
    lo = our_encode(pos[:-1], name, saturate=False)
    hi = our_encode(pos[1:], name, saturate=False)
    assert np.all((codes == lo) | (codes == hi))
    assert np.all(codes & 1 == 0), [hex(c) for c in codes[codes & 1 == 1]]
    # and the tie just past max: overflow unless max itself is even
    ulp = pos[-1] - pos[-2]
    over = np.float32(pos[-1] + ulp / 2)
    max_code = our_encode(np.float32([pos[-1]]), name)[0]
    got = our_encode(np.array([over]), name, saturate=False)[0]
    if max_code & 1 == 0:
        assert got == max_code
    else:
        assert got == (spec.layout.inf_code if spec.has_inf else spec.layout.nan_code)


@pytest.mark.parametrize("name", NAMES)
def test_encode_specials_and_overflow(name):
    spec = get_format(name)
    nan_code = FORMATS[name][2]
    x = np.concatenate([SPECIALS, [1e38, -1e38, 3.4e38, -3.4e38]]).astype(np.float32)
    got = our_encode(x, name, saturate=False)
    assert_codes_equal(got, ml_encode(x, name), name, x)
    if spec.has_negative_zero:
        assert got[:2].tolist() == [0x00, 0x80]
    else:
        assert got[:2].tolist() == [0x00, 0x00]  # fnuz: -0 -> +0 (0x80 is the NaN)
    if spec.has_inf:
        assert got[2:4].tolist() == [spec.layout.inf_code, spec.layout.inf_code | 0x80]
        assert got[6:].tolist() == [spec.layout.inf_code, spec.layout.inf_code | 0x80] * 2
    else:
        assert got[2:4].tolist() == [nan_code, nan_code]
        assert got[6:].tolist() == [nan_code] * 4
    assert got[4:6].tolist() == [nan_code, nan_code]


@pytest.mark.parametrize("name", NAMES)
def test_encode_subnormals_and_underflow(name):
    spec = get_format(name)
    tiny = spec.min_subnormal
    k = np.arange(0, 2 ** (spec.mantissa_bits + 1) + 1, dtype=np.float64)
    # every multiple of half the smallest subnormal through the first normal binade
    x = (k * tiny / 2).astype(np.float32)
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0))])
    x = np.concatenate([x, -x, np.float32([tiny / 2 * 0.999, tiny / 3, 1e-45, -1e-45])])
    got = our_encode(x, name, saturate=False)
    assert_codes_equal(got, ml_encode(x, name), name, x)
    # below half the smallest subnormal -> zero of the right sign
    below = np.float32([tiny / 2, tiny / 2 * 0.75, tiny / 8, 1e-45])
    zero_neg = 0x80 if spec.has_negative_zero else 0x00
    assert our_encode(below, name, saturate=False).tolist() == [0] * 4
    assert our_encode(-below, name, saturate=False).tolist() == [zero_neg] * 4
    # just above half: the smallest subnormal (code 0x01)
    just = np.nextafter(np.float32(tiny / 2), np.float32(1))
    assert our_encode(np.float32([just, -just]), name).tolist() == [0x01, 0x81]


@pytest.mark.parametrize("name", NAMES)
def test_encode_random_float32(name):
    rng = np.random.default_rng(1234)
    spec = get_format(name)
    n = 1 << 17  # x 8 parts: ~1M float32 per format, ~7M in all
    parts = [rng.standard_normal(n).astype(np.float32) * np.float32(s)
             for s in (spec.min_subnormal, spec.min_normal, 1.0, spec.max / 8, spec.max,
                       spec.max * 2)]
    parts.append((rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32))
    parts.append(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32))
    x = np.concatenate(parts)
    assert_codes_equal(our_encode(x, name, saturate=False), ml_encode(x, name), name, x)
    # saturating mode on the same data: ml_dtypes of the clamped input
    clamped = np.clip(x, -spec.max, spec.max)
    assert_codes_equal(our_encode(x, name), ml_encode(clamped, name), name, x)


# ------------------------------------------------------------------------------------------------
# saturating encode (default)


@pytest.mark.parametrize("name", NAMES)
def test_saturating_encode_equals_ml_dtypes_of_clamped(name):
    spec = get_format(name)
    x = np.concatenate([midpoints_and_neighbours(name), SPECIALS])
    clamped = np.clip(x, -spec.max, spec.max)
    got = our_encode(x, name)
    assert_codes_equal(got, ml_encode(clamped, name), name, x)
    max_code = our_encode(np.float32([spec.max]), name)[0]
    assert decode(torch.tensor([max_code], dtype=torch.uint8), spec).item() == spec.max
    assert our_encode(np.float32([np.inf, -np.inf, 1e30, -1e30]), name).tolist() == [
        max_code, max_code | 0x80, max_code, max_code | 0x80]


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_saturating_encode_equals_torch_cast_of_clamped(name):
    spec = get_format(name)
    rng = np.random.default_rng(7)
    x = np.concatenate([midpoints_and_neighbours(name), SPECIALS,
                        (rng.standard_normal(1 << 16) * spec.max / 4).astype(np.float32)])
    xt = torch.from_numpy(x)
    ref = xt.clamp(-spec.max, spec.max).to(FORMATS[name][1]).view(torch.uint8).numpy()
    assert_codes_equal(our_encode(x, name), ref, name, x)
    # to_torch_float8 is exactly that saturating cast: bit for bit our encode (torch keeps the
    # NaN's sign / writes 0x7F for e5m2 NaN, so NaNs are compared by NaN-ness there)
    f8 = to_torch_float8(xt, spec)
    assert f8.dtype == FORMATS[name][1]
    assert_codes_equal(our_encode(x, name), f8.view(torch.uint8).numpy(), name, x)


@pytest.mark.parametrize("name", [n for n in TORCH_NAMES if n != "e4m3"])
def test_unsaturated_encode_equals_torch_cast(name):
    """torch's cast to e5m2 / the fnuz dtypes does not saturate: it equals saturate=False."""
    x = np.concatenate([midpoints_and_neighbours(name), SPECIALS])
    ref = torch.from_numpy(x).to(FORMATS[name][1]).view(torch.uint8).numpy()
    assert_codes_equal(our_encode(x, name, saturate=False), ref, name, x)


def test_torch_e4m3fn_cast_saturates():
    """torch's float -> float8_e4m3fn cast saturates finite overflow and +-inf to +-448 (unlike
    ml_dtypes, which gives NaN): it equals our *saturating* encode on non-NaN input."""
    x = np.concatenate([midpoints_and_neighbours("e4m3"), SPECIALS])
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert_codes_equal(our_encode(x, "e4m3"), ref, "e4m3", x)


# ------------------------------------------------------------------------------------------------
# quantize_values / decode / fake_quantize consistency


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("saturate", [True, False])
def test_decode_encode_equals_quantize_values(name, saturate):
    spec = get_format(name)
    rng = np.random.default_rng(3)
    x = np.concatenate([midpoints_and_neighbours(name), SPECIALS,
                        (rng.standard_normal(1 << 15) * spec.max / 3).astype(np.float32)])
    xt = torch.from_numpy(x)
    q = quantize_values(xt, spec, saturate=saturate)
    assert q.dtype == torch.float32 and q.shape == xt.shape
    dq = decode(encode(xt, spec, saturate=saturate), spec)
    assert torch.equal(torch.isnan(q), torch.isnan(dq))
    fin = ~torch.isnan(q)
    assert torch.equal(q[fin], dq[fin])
    assert torch.equal(torch.signbit(q[fin]), torch.signbit(dq[fin]))
    # and with ml_dtypes' round trip (values, NaN-ness)
    src = np.clip(x, -spec.max, spec.max) if saturate else x
    ref = ml_encode(src, name).view(FORMATS[name][0]).astype(np.float32)
    assert np.array_equal(q.numpy(), ref, equal_nan=True)
    assert np.array_equal(np.signbit(q.numpy()[fin.numpy()]), np.signbit(ref[fin.numpy()]))
    # idempotent
    assert torch.equal(quantize_values(q, spec, saturate=saturate)[fin], q[fin])


@pytest.mark.parametrize("name", NAMES)
def test_nan_to_zero(name):
    spec = get_format(name)
    x = torch.tensor([math.nan, -math.nan, 1.0, math.inf])
    q = quantize_values(x, spec, nan_to_zero=True)
    assert q.tolist() == [0.0, 0.0, 1.0, spec.max]
    assert encode(x, spec, nan_to_zero=True)[:2].tolist() == [0, 0]


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_fake_quantize_fast_path_is_taken(name):
    spec = get_format(name)
    assert codec._native_fast_path(spec, {})
    assert codec._native_fast_path(spec, {"rounding": "nearest_even", "saturate": True})
    assert not codec._native_fast_path(spec, {"saturate": False})
    assert not codec._native_fast_path(spec, {"nan_to_zero": True})
    assert not codec._native_fast_path(spec, {"rounding": "half_away"})


def _fq_reference(x, scale, spec, **kw):
    xf = x.float()
    return (quantize_values(xf / scale, spec, **kw) * scale).to(x.dtype)


def _assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    fin = ~torch.isnan(a)
    assert torch.equal(a[fin], b[fin])
    assert torch.equal(torch.signbit(a[fin]), torch.signbit(b[fin]))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_fake_quantize_equals_generic_path(name):
    spec = get_format(name)
    rng = np.random.default_rng(11)
    base = np.concatenate([midpoints_and_neighbours(name), SPECIALS,
                           rng.standard_normal(1 << 16).astype(np.float32) * 3,
                           rng.integers(0, 2**32, 1 << 14, dtype=np.uint64).astype(
                               np.uint32).view(np.float32)])
    x = torch.from_numpy(base)
    for scale in (1.0, 0.37, 2.0 ** -5, 1e3, torch.tensor(0.0123), torch.tensor([7.5])):
        _assert_same(fake_quantize(x, scale, spec), _fq_reference(x, scale, spec))
    # per-channel scale broadcasting over a 2-D tensor
    x2 = torch.from_numpy(rng.standard_normal((64, 96)).astype(np.float32)) * 10
    s2 = torch.from_numpy(rng.uniform(0.01, 1.0, (64, 1)).astype(np.float32))
    _assert_same(fake_quantize(x2, s2, spec), _fq_reference(x2, s2, spec))
    # lower-precision inputs keep their dtype
    for dt in (torch.bfloat16, torch.float16):
        xd = x2.to(dt)
        out = fake_quantize(xd, s2, spec)
        assert out.dtype == dt
        _assert_same(out, _fq_reference(xd, s2, spec))
    # explicit kwargs that still use the fast path, and ones that leave it
    _assert_same(fake_quantize(x, 0.5, spec, rounding="nearest_even", saturate=True),
                 _fq_reference(x, 0.5, spec))
    _assert_same(fake_quantize(x, 0.5, spec, saturate=False),
                 _fq_reference(x, 0.5, spec, saturate=False))
    _assert_same(fake_quantize(x, 0.5, spec, nan_to_zero=True),
                 _fq_reference(x, 0.5, spec, nan_to_zero=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCH_NAMES)
def test_fake_quantize_large_tensor_fast_path_bit_exact(name):
    """A tensor large enough for any chunking / multithreading in the fast path."""
    spec = get_format(name)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 21, generator=g) * spec.max / 2
    x[::997] = torch.tensor(math.nan)
    x[1::1009] = torch.tensor(math.inf)
    x[2::1013] = -0.0
    s = torch.tensor(0.73)
    _assert_same(fake_quantize(x, s, spec), _fq_reference(x, s, spec))
    x2 = x.reshape(1024, 2048)[:, ::2]  # non-contiguous
    _assert_same(fake_quantize(x2, s, spec), _fq_reference(x2, s, spec))


# ------------------------------------------------------------------------------------------------
# torch float8 round trips


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_torch_float8_round_trip(name):
    spec = get_format(name)
    codes = torch.arange(256, dtype=torch.uint8)
    values = decode(codes, spec)
    f8 = to_torch_float8(values, spec)
    back = f8.view(torch.uint8)
    not_nan = ~torch.isnan(values)
    fin = torch.isfinite(values)
    assert torch.equal(back[fin], codes[fin])  # every finite code survives
    if spec.has_inf:  # the cast saturates: +-inf -> +-max
        max_code = encode(torch.tensor([spec.max]), spec).item()
        assert back[values == math.inf].tolist() == [max_code]
        assert back[values == -math.inf].tolist() == [max_code | 0x80]
    assert torch.isnan(f8[~not_nan].float()).all()
    assert torch.equal(codes_as_torch_float8(back, spec).float()[fin], values[fin])
    # codes -> float8 view -> float32 == decode
    assert torch.equal(codes_as_torch_float8(codes, spec).float()[not_nan], values[not_nan])
    # encode == to_torch_float8 bits for random data
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * spec.max
    assert torch.equal(encode(x, spec), to_torch_float8(x, spec).view(torch.uint8))


@pytest.mark.parametrize("name", [n for n in NAMES if n not in TORCH_NAMES])
def test_torch_float8_unavailable_raises(name):
    spec = get_format(name)
    assert torch_dtype(spec) is None
    with pytest.raises(ValueError):
        to_torch_float8(torch.zeros(3), spec)
    with pytest.raises(ValueError):
        codes_as_torch_float8(torch.zeros(3, dtype=torch.uint8), spec)
    # without a torch dtype fake_quantize takes the generic path
    assert not codec._native_fast_path(spec, {})


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"])
def test_bitwise_round_equals_the_float8_cast_bit_for_bit(name):
    from fp8ptq.formats.codec import _bitwise_round, _native_round

    spec = get_format(name)
    grid = spec.layout.values.float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    z = torch.cat([torch.randn(20000, generator=g) * 10.0 ** e for e in range(-12, 7)] + [
        grid, mids, torch.nextafter(mids, torch.tensor(1e9)),
        torch.nextafter(mids, torch.tensor(-1e9)),
        torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45])]).float()
    fast = _bitwise_round(z, spec)
    assert torch.equal(fast.view(torch.int32), _native_round(z, spec).view(torch.int32))
    assert torch.isnan(_bitwise_round(torch.tensor([float("nan")]), spec)).all()


def test_tables_first_built_in_inference_mode_are_plain_tensors():
    """A format's cached tables may first be built inside a calibration forward
    (``torch.inference_mode()``); they must still be plain tensors, or a later autograd or
    tracing-mode use of the same format (a fake-CUDA run, a gradient through ``decode``)
    refuses them."""
    import dataclasses

    from fp8ptq.formats import decode, encode, get_format
    from fp8ptq.formats.binades import binade_tables

    fresh = dataclasses.replace(get_format("e4m3"), name="e4m3-fresh")  # nothing cached yet
    with torch.inference_mode():
        codes = encode(torch.linspace(-400, 400, 101), fresh)
        assert not fresh.layout.values.is_inference()
        assert not binade_tables(fresh).step.is_inference()
    x = torch.linspace(-1, 1, 11, requires_grad=True)
    (decode(codes, fresh)[:11] * x).sum().backward()  # the cached values usable by autograd
    assert x.grad is not None
