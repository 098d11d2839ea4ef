"""MX block scaling (OCP Microscaling Formats (MX) Specification v1.0, 2023, section 6.3).

A block is ``k = 32`` consecutive values along the reduction (last) dimension. It shares one
E8M0 scale ``X = 2^e`` with ``e = floor(log2(amax)) - emax_elem`` (``emax_elem`` = exponent of
the element format's largest normal: 8 for e4m3, 15 for e5m2), clamped to E8M0's finite range
``[-127, 127]``; each element is ``V / X`` rounded to nearest-even and *saturated* to the element
format's max (the spec clamps overflowing normals rather than producing inf/NaN).

Why a module of its own rather than another calibrator: the scale is not chosen from data
statistics beyond the block's amax, it is a power of two fixed by the rule above, so weights and
dynamic activations share one function and the result is bit-exact by construction.

E8M0 codes are the biased exponent ``e + 127`` in a uint8 (255 is NaN, never produced here),
the same ``scale_dtype=uint8`` form compressed-tensors 0.20 uses in its ``MXFP8`` preset
(``strategy: group, group_size: 32``). Note compressed-tensors' own scale generator rounds the
amax to a power of two *to nearest* before flooring, which differs from the spec's floor for
blocks whose amax mantissa is >= 1.5 (there it picks a scale one binade larger); fp8ptq follows
the spec.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import FormatSpec, decode, encode, quantize_values
from .granularity import PerGroup

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_MIN, E8M0_MAX = -127, 127
E8M0_NAN = 255


def emax_elem(spec: FormatSpec) -> int:
    """Exponent of the element format's largest finite value (8 for e4m3, 15 for e5m2)."""
    return math.floor(math.log2(spec.max))


def shared_exponent(amax: torch.Tensor, spec: FormatSpec, *, strict: bool = True) -> torch.Tensor:
    """The E8M0 exponents of blocks with the given ``amax``, by the format's rule
    (``spec.mx_scale_rounding``): :func:`shared_exponent_floor` (the OCP spec's) or
    :func:`shared_exponent_round_up` (NVIDIA's kernels')."""
    if spec.mx_scale_rounding == "ceil":
        return shared_exponent_round_up(amax, spec, strict=strict)
    return shared_exponent_floor(amax, spec, strict=strict)


def _guarded(amax, strict: bool, exponent) -> torch.Tensor:
    """``exponent(amax, ok)`` (float64 amax; ``ok``: the finite, positive blocks, whose
    exponents it must get right) clamped to E8M0's range, the other blocks' settled by the
    rules both exponent rules share: an all-zero block gets the smallest scale (its elements
    are zero whatever the scale); a non-finite amax raises (``strict``) or gets the largest
    scale (the spec would give the block a NaN scale; a running model's activations must not
    turn into NaN for a stray inf)."""
    amax = torch.as_tensor(amax).double()  # log2 of float32 subnormals and exact floors
    finite = torch.isfinite(amax)
    if strict and not bool(finite.all()):
        raise ValueError("MX scaling: non-finite values in the block")
    e = exponent(amax, finite & (amax > 0)).to(torch.int32)
    e = torch.where(amax > 0, e, torch.full_like(e, E8M0_MIN))
    e = torch.where(finite, e, torch.full_like(e, E8M0_MAX))
    return e.clamp(E8M0_MIN, E8M0_MAX)


def shared_exponent_floor(amax: torch.Tensor, spec: FormatSpec, *,
                          strict: bool = True) -> torch.Tensor:
    """``floor(log2 amax) - emax_elem`` clamped to E8M0's range (int32), with
    :func:`_guarded`'s zero / non-finite rules."""
    def exponent(a, ok):
        _, frexp_exp = torch.frexp(torch.where(ok, a, torch.ones_like(a)))
        return frexp_exp - 1 - emax_elem(spec)
    return _guarded(amax, strict, exponent)


def shared_exponent_round_up(amax: torch.Tensor, spec: FormatSpec, *,
                             strict: bool = True) -> torch.Tensor:
    """The exponent NVIDIA's MXFP8 kernels pick instead of the spec's floor: the smallest
    power of two ``2^e >= amax / max_elem`` (TensorRT-LLM / FlashInfer's ``mxfp8_quantize``,
    which vLLM's MXFP8 path calls: ``amax / 448`` converted to E8M0 rounding toward +inf).
    No element saturates, where the spec's rule clips a block's largest values in
    ``(max_elem, 2^(emax_elem + 1))`` (e4m3: (448, 512) times the scale) to ``max_elem``.
    Same guards as :func:`shared_exponent_floor`. ``--format mxfp8-ceil`` uses it."""
    def exponent(a, ok):
        # a divisor on a's device: CUDA's division by a host number is a reciprocal
        # multiplication, an ulp off at powers of two (see formats.scales.divide)
        ratio = torch.where(ok, a / torch.full((), spec.max, dtype=a.dtype, device=a.device),
                            torch.ones_like(a))
        mant, frexp_exp = torch.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
        return torch.where(mant == 0.5, frexp_exp - 1, frexp_exp)
    return _guarded(amax, strict, exponent)


def mx_scale(amax: torch.Tensor, spec: FormatSpec, *, strict: bool = True) -> torch.Tensor:
    """The E8M0 scales ``2^shared_exponent`` of blocks with the given ``amax``, as float32
    (exact: every E8M0 value is a float32, 2^-127 as a subnormal)."""
    e = shared_exponent(amax, spec, strict=strict)
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e.double()).float()


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``x`` as ``[..., n_blocks, block]`` (last dim zero-padded; zeros do not change amax)."""
    n = x.shape[-1]
    pad = (-n) % block
    xp = F.pad(x.float(), (0, pad)) if pad else x.float()
    return xp.reshape(*x.shape[:-1], -1, block), n


def mx_quantize(x: torch.Tensor, spec: FormatSpec, block: int = MX_BLOCK):
    """Split ``x`` into MX blocks along its last dim: returns ``(elements, exponents)`` with
    ``elements`` float32 values on ``spec``'s grid (shape of ``x``) and ``exponents`` int32
    shared exponents ``[..., ceil(n / block)]``, so ``x ~ elements * 2^exponents``."""
    xb, n = _blocks(x, block)
    amax = PerGroup(block).amax(xb.flatten(-2))
    e = shared_exponent(amax, spec)
    # V / 2^e in float64 is exact and lands inside float32's range for every clamped e.
    y = torch.ldexp(xb.double(), (-e).double().unsqueeze(-1)).float()
    q = quantize_values(y, spec, rounding="nearest_even", saturate=True)
    return q.flatten(-2)[..., :n], e


def mx_fake_quantize(x: torch.Tensor, spec: FormatSpec, block: int = MX_BLOCK) -> torch.Tensor:
    """Quantize-dequantize ``x`` through MX blocks, in ``x``'s dtype."""
    q, e = mx_quantize(x, spec, block)
    qb, n = _blocks(q, block)
    out = torch.ldexp(qb.double(), e.double().unsqueeze(-1)).flatten(-2)[..., :n]
    return out.to(x.dtype)


def e8m0_encode(e: torch.Tensor) -> torch.Tensor:
    return (e.to(torch.int32) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """Float32 scales ``2^(code - 127)``; code 255 is NaN (spec section 5.4.1)."""
    e = codes.to(torch.int32) - E8M0_BIAS
    s = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e.double()).float()
    return torch.where(codes == E8M0_NAN, torch.full_like(s, torch.nan), s)


def mx_encode(x: torch.Tensor, spec: FormatSpec, block: int = MX_BLOCK):
    """Storage form: ``(element codes uint8 [..., n], E8M0 scale codes uint8 [..., blocks])``."""
    q, e = mx_quantize(x, spec, block)
    return encode(q, spec), e8m0_encode(e)


def mx_decode(codes: torch.Tensor, scales: torch.Tensor, spec: FormatSpec,
              block: int = MX_BLOCK, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`mx_encode` (exact: elements times powers of two)."""
    q = decode(codes, spec)
    qb, n = _blocks(q, block)
    out = (qb.double() * e8m0_decode(scales).double().unsqueeze(-1)).flatten(-2)[..., :n]
    return out.to(dtype)
