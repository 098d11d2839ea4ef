"""IBM HFP8 forward format (1-4-3, exponent bias 4 on top of 7 = 11, max 30, flush below 2^-11).

Reference: ml_dtypes.float8_e4m3b11fnuz has the same bias and specials but keeps subnormals;
HFP8 as fp8ptq reads Sun et al. 2019 has none, so the two agree wherever the exponent field is
not 0.
"""

from __future__ import annotations

import inspect
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8ptq.formats import (
    codec,
    decode,
    encode,
    fake_quantize,
    get_format,
    quantize_values,
    registry,
)

HFP8 = get_format("hfp8")
B11 = ml_dtypes.float8_e4m3b11fnuz
CODES = np.arange(256, dtype=np.uint8)
EXP_FIELD = (CODES >> 3) & 0xF


def enc(x, **kw) -> np.ndarray:
    return encode(torch.from_numpy(np.asarray(x, dtype=np.float32)), HFP8, **kw).numpy()


def ml(x) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(B11).view(np.uint8)


def test_spec_facts():
    assert (HFP8.exponent_bits, HFP8.mantissa_bits, HFP8.bias) == (4, 3, 11)
    assert HFP8.specials == "fnuz" and HFP8.subnormals is False
    assert HFP8.max == 30.0 == 1.875 * 2**4
    assert HFP8.min_normal == 2.0**-10
    assert HFP8.min_subnormal == 2.0**-10  # no subnormals: the smallest non-zero is normal
    assert not HFP8.has_inf and HFP8.has_nan and not HFP8.has_negative_zero
    assert HFP8.layout.nan_code == 0x80
    assert HFP8.binades == 15  # 2^-10 .. 2^4
    assert HFP8.torch_dtype is None and not codec._native_fast_path(HFP8, {})
    d = HFP8.describe()
    assert d["max"] == 30.0 and d["min_subnormal"] == 2.0**-10 and d["has_inf"] is False


def test_choice_is_documented_in_registry():
    src = inspect.getsource(registry)
    i = src.index('FormatSpec("hfp8"')
    comment = src[src.rindex("# IBM HFP8", 0, i):i]
    for phrase in ("bias 11", "FNUZ", "30", "2^-11", "subnormals", "flush"):
        assert phrase in comment, phrase
    assert "flush below 2^-11" in HFP8.description


def test_decode_normals_equal_e4m3b11fnuz():
    ref = CODES.view(B11).astype(np.float64)
    ours = decode(torch.arange(256, dtype=torch.uint8), HFP8, torch.float64).numpy()
    sel = (EXP_FIELD != 0) | (CODES == 0x00) | (CODES == 0x80)
    assert sel.sum() == 256 - 14
    assert np.array_equal(ours[sel], ref[sel], equal_nan=True)
    assert np.isnan(ours[0x80]) and np.isnan(ours).sum() == 1  # one NaN, the -0 pattern
    assert ours[0x00] == 0 and not np.signbit(ours[0x00])


def test_decode_exponent_field_zero_is_plus_zero():
    for code in [c for c in range(256) if (c >> 3) & 0xF == 0 and c != 0x80]:
        v = decode(torch.tensor([code], dtype=torch.uint8), HFP8, torch.float64).item()
        assert v == 0.0 and math.copysign(1.0, v) == 1.0, hex(code)
    # ml_dtypes keeps them as subnormals: that is the difference
    assert CODES[1:8].view(B11).astype(np.float64).tolist() == [k * 2.0**-13 for k in range(1, 8)]


def test_decode_all_codes_by_formula():
    for code in range(256):
        v = decode(torch.tensor([code], dtype=torch.uint8), HFP8, torch.float64).item()
        s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
        if code == 0x80:
            assert math.isnan(v)
        elif e == 0:
            assert v == 0.0
        else:
            assert v == (-1) ** s * (1 + m / 8) * 2.0 ** (e - 11), hex(code)


def test_encode_flush_to_zero_threshold():
    t = np.float32(2.0**-11)
    below = np.float32([np.nextafter(t, np.float32(0)), 2.0**-12, 2.0**-13 * 3, 1e-20, 1e-45, 0.0])
    assert enc(below).tolist() == [0] * 6
    assert enc(-below).tolist() == [0] * 6  # no -0: negative underflow is code 0x00 too
    q = quantize_values(torch.from_numpy(-below), HFP8)
    assert (q == 0).all() and not torch.signbit(q).any()
    # exactly 2^-11 is the tie between 0 and 2^-10: round-half-even keeps 0 ...
    assert enc([t, -t]).tolist() == [0, 0]
    # ... half-away (and anything just above) gives 2^-10 (code 0x08: exponent 1, mantissa 0)
    assert encode(torch.tensor([t, -t]), HFP8, rounding="half_away").tolist() == [0x08, 0x88]
    above = np.float32([np.nextafter(t, np.float32(1)), 2.0**-11 * 1.5, 2.0**-10 * 0.99])
    assert enc(above).tolist() == [0x08] * 3
    assert enc(-above).tolist() == [0x88] * 3
    assert quantize_values(torch.from_numpy(above), HFP8).tolist() == [2.0**-10] * 3


def test_encode_normals_equal_e4m3b11fnuz():
    ref_vals = CODES.view(B11).astype(np.float64)
    normal = np.unique(np.abs(ref_vals[(EXP_FIELD != 0) & ~np.isnan(ref_vals)]))
    mids = (normal[:-1] + normal[1:]) / 2
    pts = np.concatenate([normal, mids, [30 + 1, 32, 1e6, 3e38]]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                          np.nextafter(pts, np.float32(0))])
    pts = pts[np.abs(pts) >= 2.0**-10]
    pts = np.concatenate([pts, -pts])
    for saturate in (False, True):
        ref = ml(np.clip(pts, -30, 30) if saturate else pts)
        got = enc(pts, saturate=saturate)
        bad = np.nonzero(got != ref)[0]
        assert bad.size == 0, [(pts[i], hex(got[i]), hex(ref[i])) for i in bad[:5]]
    # overflow without saturation is the NaN 0x80 (no inf); with saturation +-30
    assert enc([31, -1e9, np.inf, -np.inf], saturate=False).tolist() == [0x80] * 4
    assert enc([31, -1e9, np.inf, -np.inf]).tolist() == [0x7F, 0xFF, 0x7F, 0xFF]
    assert enc([np.nan, -np.nan]).tolist() == [0x80, 0x80]
    # round-half-even at the top: 30 (mantissa 111, odd) + half ulp overflows
    assert enc([31.0], saturate=False).tolist() == [0x80]
    assert enc([np.nextafter(np.float32(31.0), np.float32(0))], saturate=False).tolist() == [0x7F]


def test_encode_random_against_e4m3b11fnuz():
    rng = np.random.default_rng(2024)
    n = 1 << 18
    x = np.concatenate([
        (rng.standard_normal(n) * 2.0 ** rng.integers(-14, 6, n)).astype(np.float32),
        rng.integers(0, 2**32, n // 4, dtype=np.uint64).astype(np.uint32).view(np.float32),
    ])
    got = enc(x, saturate=False)
    ref = ml(x)
    ax = np.abs(x)
    big = ax >= 2.0**-10
    nan = np.isnan(ref.view(B11).astype(np.float32))
    assert np.array_equal(got[nan], np.full(nan.sum(), 0x80, np.uint8))
    assert np.array_equal(got[big & ~nan], ref[big & ~nan])
    small = ~big & ~np.isnan(x)
    want = np.where(ax[small] > 2.0**-11, np.where(x[small] < 0, 0x88, 0x08), 0x00)
    assert np.array_equal(got[small], want.astype(np.uint8))
    # values: decode(encode) == quantize_values everywhere
    xt = torch.from_numpy(x)
    q = quantize_values(xt, HFP8, saturate=False)
    dq = decode(torch.from_numpy(got), HFP8)
    assert torch.equal(torch.isnan(q), torch.isnan(dq))
    assert torch.equal(q.nan_to_num(7.0), dq.nan_to_num(7.0))


def test_every_nonzero_value_round_trips():
    vals = decode(torch.arange(256, dtype=torch.uint8), HFP8)
    fin = torch.isfinite(vals) & (vals != 0)
    assert int(fin.sum()) == 2 * 15 * 8  # 15 exponent fields x 8 mantissas, both signs
    assert torch.equal(encode(vals[fin], HFP8), torch.arange(256, dtype=torch.uint8)[fin])
    assert torch.equal(quantize_values(vals[fin], HFP8), vals[fin])


@pytest.mark.parametrize("rounding", ["half_away", "nearest_even"])
def test_flush_region_rounds_to_nearest(rounding):
    """In [0, 2^-10] the only neighbours are 0 and 2^-10."""
    x = torch.linspace(0, 2.0**-10, 1001)
    q = quantize_values(x, HFP8, rounding=rounding)
    assert set(q.unique().tolist()) <= {0.0, 2.0**-10}
    assert torch.equal(q[x < 2.0**-11], torch.zeros_like(q[x < 2.0**-11]))
    assert (q[x > 2.0**-11] == 2.0**-10).all()


def test_flush_region_stochastic_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 0.3 * 2.0**-10)
    q = quantize_values(x, HFP8, rounding="stochastic", generator=g)
    assert set(q.unique().tolist()) <= {0.0, 2.0**-10}
    assert abs(q.mean().item() / 2.0**-10 - 0.3) < 0.01


def test_fake_quantize_with_scale():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g)
    scale = x.abs().max() / HFP8.max
    y = fake_quantize(x, scale, HFP8)
    ref = quantize_values(x / scale, HFP8) * scale
    assert torch.equal(y, ref)
    assert (y.abs() <= x.abs().max() * (1 + 1e-6)).all()
    # small values flush: |x/scale| < 2^-11 -> 0
    tiny = torch.tensor([0.9 * 2.0**-11, 1.1 * 2.0**-11]) * scale
    assert fake_quantize(tiny, scale, HFP8).tolist() == [0.0, (2.0**-10 * scale).item()]
