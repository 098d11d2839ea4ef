"""The integer-bit codec (binade tables) against the original frexp/ldexp rounding and the
binary-search encoder, on random and edge values for every format and rounding mode."""

import dataclasses

import pytest
import torch

from fp8ptq.formats import codec
from fp8ptq.formats.registry import get_format, preset_names

FORMATS = sorted(set(preset_names()) | {"e3m4", "e2m5", "e5m2b10", "e4m3b5fn", "e3m2", "e6m1"})


def _reference_quantize(x, spec, rounding, generator=None):
    """The original rounding: binade from frexp, spacing via ldexp (no bit tricks)."""
    src, x = x, x.float()
    lay = spec.layout
    a = x.abs()
    _, fe = torch.frexp(a)
    binade = (fe - 1).clamp(lay.e_lo, lay.e_hi)
    step = lay.step_log2[(binade - lay.e_lo).long()]
    y = torch.ldexp(a, -step)
    whole = torch.floor(y)
    up = codec._round_up(whole, y - whole, rounding, src, fe - 1, generator)
    q = torch.ldexp(whole + up, step)
    q = torch.where(q > lay.max, torch.full_like(q, lay.max), q)
    q = torch.copysign(q, x)
    return q if lay.has_negative_zero else torch.where(q == 0, torch.zeros_like(q), q)


def _values(spec, n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = spec.layout
    grid = lay.values.float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # exact ties
    rand = torch.randn(n, generator=g) * lay.max / 4
    tiny = torch.randn(n, generator=g) * lay.min_positive * 4
    logu = torch.exp2(torch.empty(n).uniform_(-140, 130, generator=g)) * torch.sign(
        torch.randn(n, generator=g))
    edge = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, lay.max, -lay.max, lay.max * 1.01,
                         3e38, -3e38, torch.inf, -torch.inf])
    return torch.cat([grid, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                      torch.nextafter(mids, mids * 2), rand, tiny, logu, edge])


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rounding", ["nearest_even", "half_away", "stochastic", "hybrid"])
def test_fast_rounding_matches_reference(name, rounding):
    spec = get_format(name)
    if not spec.is_float:
        pytest.skip("integer formats round with torch.round / floor")
    spec = dataclasses.replace(spec, rounding=rounding)
    x = _values(spec)
    for src in (x, x.bfloat16()):  # hybrid reads the source's own bits (SR14 / SR2)
        got = codec.quantize_values(src, spec, generator=torch.Generator().manual_seed(1))
        want = _reference_quantize(src, spec, rounding, torch.Generator().manual_seed(1))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("saturate", [True, False])
def test_fast_encode_matches_binary_search(name, saturate):
    spec = get_format(name)
    x = _values(spec, seed=3)
    if spec.layout.has_nan:
        x = torch.cat([x, torch.tensor([torch.nan])])
    got = codec.encode(x, spec, saturate=saturate)
    want = codec.encode_reference(x, spec, saturate=saturate)
    assert torch.equal(got, want)
    # the codes decode to the quantized values (round trip through the 256-entry table)
    q = codec.quantize_values(x, spec, saturate=saturate)
    back = codec.decode(got, spec)
    same = (back == q) | (torch.isnan(back) & torch.isnan(q))
    assert bool(same.all())


@pytest.mark.parametrize("name", ["hif8", "hfp8", "e3m4", "e4m3", "int8"])
def test_chunked_codec_is_bit_identical(name, monkeypatch):
    spec = get_format(name)
    x = _values(spec, n=2000, seed=5)
    whole_q = codec.quantize_values(x, spec)
    whole_c = codec.encode(x, spec)
    monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 1000)  # x has > 2 chunks: the chunked path
    assert x.numel() > 2000
    assert torch.equal(codec.quantize_values(x, spec).view(torch.int32), whole_q.view(torch.int32))
    assert torch.equal(codec.encode(x, spec), whole_c)
