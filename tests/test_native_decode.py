"""The decode kernel (``codec.dequantize``) and the scaled encode (``codec.encode_scaled``)
against their torch expressions, bit for bit, and ``QuantGemm`` built through them: the same
weight and codes as the row-chunked torch path, for every granularity."""

import dataclasses

import pytest
import torch

from fp8ptq.formats import codec
from fp8ptq.formats.granularity import PerToken, weight_granularity
from fp8ptq.formats.registry import get_format
from fp8ptq.nn.quant_gemm import QuantGemm
from fp8ptq.runtime import native
from test_native import FORMATS, _both, _inputs, _same, needs_native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _codes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Every one of the 256 codes, shuffled, in an odd-width matrix."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.arange(256, dtype=torch.uint8).repeat(rows * cols // 256 + 1)
    return flat[torch.randperm(flat.numel(), generator=g)][:rows * cols].reshape(rows, cols)


def _scales(rows: int, cols: int):
    g = torch.Generator().manual_seed(1)
    return [None, 0.37, torch.tensor(2.5), torch.tensor(3.0, dtype=torch.float64),
            torch.rand(1, cols, generator=g) + 0.01, torch.rand(rows, 1, generator=g) + 0.01,
            torch.full((rows, 1), 1e-30), torch.full((1, 1), 3e38)]  # underflow / overflow


@needs_native
@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_is_bit_identical(name, monkeypatch):
    spec = get_format(name)
    codes = _codes(29, 37)
    if spec.layout.values.numel() < 256:  # 4-bit formats: 16 codes
        codes %= spec.layout.values.numel()
    ran = []
    real = native.decode
    monkeypatch.setattr(native, "decode", lambda *a: ran.append(1) or real(*a))
    for dtype in DTYPES:
        for scale in _scales(*codes.shape):
            got, want = _both(lambda: codec.dequantize(codes, scale, spec, dtype))
            assert got.dtype == dtype and _same(got, want), (name, dtype, scale)
            ref = spec.layout.values.float()[codes.long()]
            ref = (ref if scale is None else ref * scale).to(dtype)
            assert _same(got, ref), (name, dtype, scale)
        got, want = _both(lambda: codec.decode(codes[:3], spec, dtype))
        assert _same(got, want) and _same(got, spec.layout.values.to(dtype)[codes[:3].long()])
    codes3 = codes[:12].reshape(4, 3, 37)  # per-row scales of a 3-D tensor
    scale3 = torch.rand(4, 3, 1, generator=torch.Generator().manual_seed(4)) + 0.5
    got, want = _both(lambda: codec.dequantize(codes3, scale3, spec))
    assert _same(got, want)
    if spec.layout.values.numel() == 256:  # the kernel ran, not only the torch path twice
        assert len(ran) > 8 * len(DTYPES)


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("name", FORMATS)
def test_encode_scaled_is_encode_of_the_quotient(name):
    base = get_format(name)
    g = torch.Generator().manual_seed(2)
    for rounding in ("nearest_even", "half_away"):
        spec = dataclasses.replace(base, rounding=rounding)
        for x in _inputs(spec):
            x2 = x[: x.numel() // 37 * 37].reshape(-1, 37)
            for scale in (0.37, torch.tensor(2.5), torch.rand(1, 37, generator=g) + 0.01,
                          torch.rand(x2.shape[0], 1, generator=g) + 0.01):
                want = codec.encode(x2.float() / scale, spec)
                got, torch_path = _both(lambda: codec.encode_scaled(x2, scale, spec))
                assert _same(got, want) and _same(torch_path, want), (name, x.dtype, scale)


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("name", ["e4m3", "e5m2", "hif8", "int8", "e2m5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantgemm_is_the_same_whichever_path_builds_it(granularity, name, dtype, monkeypatch):
    """One pass of the kernels (tensor / channel scales) or row chunks through torch (block
    scales, or ``FP8PTQ_NATIVE=0``): the same dequantized weight, codes and ``holds_codes``."""
    calls = []
    real = native.decode
    monkeypatch.setattr(native, "decode",
                        lambda t, c, *a: calls.append(c.shape) or real(t, c, *a))
    torch.manual_seed(0)
    spec, gran = get_format(name), weight_granularity(granularity, 128)
    lin = torch.nn.Linear(300, 257).to(dtype)
    w = lin.weight.detach().float()
    scale = gran.amax(w) / spec.max
    codes = codec.encode(w / gran.expand(scale, w), spec)

    def build():
        inner = torch.nn.Linear(300, 257).to(dtype)
        inner.load_state_dict(lin.state_dict())
        q = QuantGemm(inner, weight_format=spec, weight_codes=codes, weight_scale=scale,
                      weight_granularity=gran, act_format=None, input_scale=None)
        return q.weight.detach().clone(), q.weight_codes, q.holds_codes, \
            q.dequantized_weight_2d()

    fast, slow = _both(build)
    if native.available() and granularity != "block":  # whole weights, one call each
        assert calls[:2] == [codes.shape, codes.shape]
    want = (spec.layout.values.float()[codes.long()] * gran.expand(scale, w)).to(dtype)
    assert _same(fast[0], want) and _same(slow[0], want)
    assert torch.equal(fast[1], codes) and torch.equal(slow[1], codes)
    assert fast[2] == slow[2] is False
    assert _same(fast[3], slow[3]) and fast[3].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_amax_is_torch_s(dtype):
    """Dynamic per-token scales read their amax through the row kernel: torch's value bit for
    bit (NaN rows stay NaN, -0 and inf as torch), for 2-D / 3-D inputs, odd widths, no rows."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 7, 37, generator=g) * 30).to(dtype)
    x[0, 0, 3], x[1, 2, 0], x[2, 3, 36], x[3, 1] = torch.nan, torch.inf, -torch.inf, -0.0
    for t in (x, x[0], x[:, :, :1], x[:0], x.transpose(0, 1)):
        got, want = _both(lambda: PerToken().amax(t))
        ref = t.abs().amax(dim=-1, keepdim=True).float()
        assert got.shape == ref.shape and _same(got, ref) and _same(want, ref)
