"""MXFP8 (OCP MX v1.0 section 6.3) block scaling: hand-computed blocks, the spec's clamps,
an independent per-element reference, storage round trip, compressed-tensors' E8M0 reading."""

import math

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.quant_scheme import MXFP8
from compressed_tensors.quantization.utils.mxfp_utils import (
    maybe_convert_from_mx_exp,
    should_generate_mx_scales,
)

from fp8ptq.formats import FormatSpec, get_format
from fp8ptq.formats.granularity import PerGroup
from fp8ptq.formats.mx import (
    e8m0_decode,
    e8m0_encode,
    emax_elem,
    mx_decode,
    mx_encode,
    mx_fake_quantize,
    mx_quantize,
    shared_exponent,
    shared_exponent_round_up,
)

E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")


def test_emax_elem():
    assert emax_elem(E4M3) == 8 and emax_elem(E5M2) == 15


def test_hand_computed_block_e4m3():
    x = torch.zeros(32)
    x[0], x[1], x[2] = 3.0, 1.0, 0.01
    q, e = mx_quantize(x, E4M3)
    # floor(log2 3) - 8 = -7: 3 * 2^7 = 384 (on the e4m3 grid), 1 -> 128, 0.01 * 128 = 1.28 -> 1.25
    assert e.tolist() == [-7]
    assert q[:3].tolist() == [384.0, 128.0, 1.25]
    assert mx_fake_quantize(x, E4M3)[:3].tolist() == [3.0, 1.0, 1.25 / 128]


@pytest.mark.parametrize("spec,expect_e", [(E4M3, -8), (E5M2, -15)])
def test_saturating_element_cast(spec, expect_e):
    """amax 1.9375: scale 2^(0 - emax); 1.9375 * 2^emax exceeds 1.75 * 2^emax -> clamps to max."""
    x = torch.zeros(32)
    x[5] = -1.9375
    q, e = mx_quantize(x, spec)
    assert e.tolist() == [expect_e]
    assert q[5].item() == -spec.max
    assert mx_fake_quantize(x, spec)[5].item() == -1.75


def test_round_up_exponent_never_saturates():
    """NVIDIA's rule (smallest 2^e >= amax / max): the same exponent as the spec's floor
    except where the floor would clip, i.e. amax / 2^floor in (max, 2^(emax + 1))."""
    amax = torch.tensor([448.0, 449.0, 512.0, 896.0, 1.0, 300.0, 224.0, 0.875, 0.0, 1.9375])
    assert shared_exponent(amax, E4M3).tolist() == [0, 0, 1, 1, -8, 0, -1, -9, -127, -8]
    assert shared_exponent_round_up(amax, E4M3).tolist() == [0, 1, 1, 1, -8, 0, -1, -9, -127,
                                                              -7]
    assert shared_exponent_round_up(torch.tensor([1.9375]), E5M2).tolist() == [-14]
    torch.manual_seed(0)
    a = torch.rand(4096).double() * 2.0 ** torch.randint(-20, 20, (4096,)).double()
    e = shared_exponent_round_up(a, E4M3).double()
    assert bool((a / torch.exp2(e) <= E4M3.max).all())  # nothing clips
    assert bool((a / torch.exp2(e - 1) > E4M3.max).all())  # the smallest such power
    with pytest.raises(ValueError, match="non-finite"):
        shared_exponent_round_up(torch.tensor([float("inf")]), E4M3)
    assert shared_exponent_round_up(torch.tensor([float("inf")]), E4M3,
                                    strict=False).tolist() == [127]


def test_ceil_format_takes_the_round_up_rule():
    """``mxfp8-ceil``: the same elements as ``mxfp8``; its exponents are the round-up rule's,
    so a block whose amax lands in (448, 512) x 2^e keeps its top value (the floor rule
    saturates it to 448 x 2^e)."""
    ceil = get_format("mxfp8-ceil")
    assert get_format("MXFP8_CEIL") is ceil and ceil.mx_scale_rounding == "ceil"
    assert get_format("mxfp8").mx_scale_rounding == "floor"
    torch.manual_seed(1)
    amax = torch.rand(512).double() * 2.0 ** torch.randint(-20, 20, (512,)).double()
    assert torch.equal(shared_exponent(amax, ceil), shared_exponent_round_up(amax, E4M3))
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 480.0, 1.0
    assert mx_fake_quantize(x, get_format("mxfp8"))[0, 0].item() == 448.0  # saturated
    assert mx_fake_quantize(x, ceil)[0, 0].item() == 480.0  # 240 x 2: on e4m3's grid
    with pytest.raises(ValueError, match="mx_scale_rounding"):
        FormatSpec("bad", 4, 3, 7, "fn", mx_block=32, mx_scale_rounding="nearest")


def test_e8m0_clamps_and_zero_block():
    x = torch.zeros(2, 32)
    x[1, 3] = 2.0 ** -130  # float32 subnormal: floor(log2) - 8 = -138 -> clamped to -127
    q, e = mx_quantize(x, E4M3)
    assert e.tolist() == [[-127], [-127]]
    assert q[1, 3].item() == 2.0 ** -3 and q[0].abs().sum() == 0
    assert mx_fake_quantize(x, E4M3)[1, 3].item() == 2.0 ** -130
    big = torch.full((32,), torch.finfo(torch.float32).max)
    assert shared_exponent(big.abs().amax().reshape(1), E4M3).tolist() == [127 - 8]
    assert shared_exponent(torch.tensor([2.0 ** 200], dtype=torch.float64), E5M2).tolist() == [127]
    with pytest.raises(ValueError):
        shared_exponent(torch.tensor([math.inf]), E4M3)


def _reference(x: torch.Tensor, spec, dtype) -> torch.Tensor:
    """Per block with Python math and torch's saturating-by-clamp float8 cast."""
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 32):
            v = x[r, b:b + 32].double()
            amax = v.abs().max().item()
            e = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax))
                                                     - emax_elem(spec)))
            y = (v / 2.0 ** e).clamp(-spec.max, spec.max).to(dtype).double()
            out[r, b:b + 32] = (y * 2.0 ** e).float()
    return out


@pytest.mark.parametrize("spec,dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_matches_independent_reference(spec, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g) * torch.logspace(-6, 6, 6).unsqueeze(1)
    x[2, 40] = 0.0
    x[3, 32:64] = 0.0
    assert torch.equal(mx_fake_quantize(x, spec), _reference(x, spec, dtype))


def test_partial_last_block_and_round_trip():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, generator=g)
    codes, scales = mx_encode(x, E4M3)
    assert codes.shape == (3, 40) and codes.dtype == torch.uint8
    assert scales.shape == (3, 2) and scales.dtype == torch.uint8
    back = mx_decode(codes, scales, E4M3)
    assert torch.equal(back, mx_fake_quantize(x, E4M3))
    # the partial block (8 values) is scaled by its own amax only
    tail = x[:, 32:].abs().amax(dim=-1)
    assert torch.equal(scales[:, 1].int() - 127, torch.floor(torch.log2(tail)).int() - 8)
    # re-quantizing the dequantized tensor is the identity (idempotent)
    assert torch.equal(mx_fake_quantize(back, E4M3), back)


def test_e8m0_codes_and_compressed_tensors_reading():
    e = torch.tensor([-127, -7, 0, 127])
    codes = e8m0_encode(e)
    assert codes.tolist() == [0, 120, 127, 254]
    assert e8m0_decode(codes).tolist() == [2.0 ** -127, 2.0 ** -7, 1.0, 2.0 ** 127]
    assert math.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8)).item())
    for args in (MXFP8["weights"], MXFP8["input_activations"]):
        assert isinstance(args, QuantizationArgs) and should_generate_mx_scales(args)
        assert args.group_size == 32 and args.strategy == "group"
        assert torch.equal(maybe_convert_from_mx_exp(args, codes[1:].float()),
                           e8m0_decode(codes[1:]))


def test_per_group_amax_expand():
    x = torch.arange(1.0, 11.0).reshape(1, 10) * torch.tensor([[1.0] * 5 + [-1.0] * 5])
    g = PerGroup(4)
    assert g.amax(x).tolist() == [[4.0, 8.0, 10.0]]
    assert g.expand(g.amax(x), x).tolist() == [[4.0] * 4 + [8.0] * 4 + [10.0] * 2]
    y = torch.randn(2, 3, 256)
    a = PerGroup(128).amax(y)
    assert a.shape == (2, 3, 2)
    assert torch.equal(a[..., 1], y[..., 128:].abs().amax(-1))
