"""Vectorised codecs: quantize to a format's grid, encode to codes, decode, fake-quantize.

``quantize_values`` rounds real numbers to the nearest representable values of a format (no
scale). ``encode`` turns those into integer codes (uint8 tensors), ``decode`` maps codes back with
a 256-entry table. ``fake_quantize`` is quantize-dequantize with a scale. All work elementwise on
whole tensors, CPU or GPU.
"""

from __future__ import annotations

import torch

from .spec import FormatSpec

_TORCH_FP8 = {
    name: getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
}


def torch_dtype(spec: FormatSpec) -> torch.dtype | None:
    """torch's float8 dtype whose bit layout equals ``spec``, if torch has one."""
    return _TORCH_FP8.get(spec.torch_dtype) if spec.torch_dtype else None


def quantize_values(x: torch.Tensor, spec: FormatSpec, *, rounding: str | None = None,
                    saturate: bool = True, nan_to_zero: bool = False,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Round ``x`` to representable values of ``spec`` (float32 result, same shape).

    Overflow saturates to +-max, or with ``saturate=False`` becomes inf (formats with inf) or NaN.
    Infinite inputs follow the same rule. NaN stays NaN unless ``nan_to_zero``.
    """
    rounding = rounding or spec.rounding
    src = x
    x = x.float()
    if not spec.is_float:
        return _quantize_int(x, spec, rounding, generator)
    lay = spec.layout
    a = x.abs()
    _, frexp_exp = torch.frexp(a)
    binade = (frexp_exp - 1).clamp_(lay.e_lo, lay.e_hi)
    step_log2 = lay.step_log2.to(x.device)[(binade - lay.e_lo).long()]
    y = torch.ldexp(a, -step_log2)  # exact: multiplication by a power of two
    whole = torch.floor(y)
    frac = y - whole  # exact for the |y| < 2^24 that matter
    up = _round_up(whole, frac, rounding, src, frexp_exp - 1, generator)
    q = torch.ldexp(whole + up, step_log2)
    overflow = q > lay.max
    if saturate:
        q = torch.where(overflow, torch.full_like(q, lay.max), q)
    else:
        q = torch.where(overflow, torch.full_like(q, torch.inf if lay.has_inf else torch.nan), q)
    q = torch.copysign(q, x)
    if not lay.has_negative_zero:
        q = torch.where(q == 0, torch.zeros_like(q), q)
    if nan_to_zero:
        q = torch.nan_to_num(q, nan=0.0, posinf=torch.inf, neginf=-torch.inf)
    return q


def _round_up(whole, frac, rounding, src, src_exponent, generator):
    """1.0 where the magnitude rounds up to the next grid point, else 0.0."""
    if rounding == "nearest_even":
        up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(whole, 2) == 1))
    elif rounding == "half_away":
        up = frac >= 0.5
    elif rounding == "stochastic":
        up = torch.rand(frac.shape, generator=generator, device=frac.device) < frac
    elif rounding == "hybrid":
        # Seed 003 eq. (3): round half away where the source exponent |E| < 4, simplified
        # stochastic rounding (SR14 for fp32 sources, SR2 for fp16/bf16) elsewhere.
        up = torch.where(src_exponent.abs() < 4, frac >= 0.5, _simplified_sr(frac, src))
    else:
        raise ValueError(f"unknown rounding {rounding!r}")
    return up.to(frac.dtype)


def _simplified_sr(frac, src):
    """Seed 003 Fig. 2: the threshold comes from the source's own low bits, no RNG.

    SR14 (fp32): fraction F14 = the 14 most significant discarded bits, threshold T14 = the 14
    least significant bits of the fp32 pattern. SR2 (fp16/bf16): F2 = the 2 most significant
    discarded bits, T2 = {LSB, 1} (thresholds 0.25 / 0.75). Rounds up when F >= T; an exactly
    representable input (no discarded bits) never rounds, which the literal F >= T would break
    for SR14 when T14 = 0.
    """
    if src.dtype in (torch.float16, torch.bfloat16):
        f2 = torch.floor(frac * 4)
        t2 = (src.view(torch.int16).to(torch.int32) & 1) * 2 + 1
        return f2 >= t2
    bits = src.float().view(torch.int32)
    f14 = torch.floor(frac * 16384)
    t14 = bits & 0x3FFF
    return (frac > 0) & (f14 >= t14)


def _quantize_int(x, spec, rounding, generator):
    qmax = spec.layout.max
    whole = torch.floor(x.abs())
    frac = x.abs() - whole
    q = torch.copysign(whole + _round_up(whole, frac, rounding, x, whole, generator), x)
    return q.clamp_(-qmax, qmax).nan_to_num_(0.0)


def encode(x: torch.Tensor, spec: FormatSpec, **kwargs) -> torch.Tensor:
    """Quantize ``x`` (already divided by its scale) and return the codes as uint8."""
    q = quantize_values(x, spec, **kwargs)
    lay = spec.layout
    if not spec.is_float:
        return q.to(torch.int8).view(torch.uint8) if spec.bits == 8 else (
            q.to(torch.int64) & (spec.num_codes - 1)).to(torch.uint8)
    mags = lay.magnitudes.to(q.device)
    finite = torch.isfinite(q)
    idx = torch.searchsorted(mags, torch.where(finite, q.abs(), 0.0).contiguous())
    code = lay.magnitude_codes.to(q.device)[idx.clamp_(max=len(mags) - 1)]
    negative = torch.signbit(q) & ((q != 0) | lay.has_negative_zero)
    code = torch.where(negative, code | lay.sign_bit, code)
    if lay.has_inf:
        code = torch.where(q == torch.inf, lay.inf_code, code)
        code = torch.where(q == -torch.inf, lay.inf_code | lay.sign_bit, code)
    if lay.has_nan:
        code = torch.where(torch.isnan(q), lay.nan_code, code)
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, spec: FormatSpec, dtype=torch.float32) -> torch.Tensor:
    """Values of uint8 codes (any shape) as ``dtype``."""
    table = spec.layout.values.to(device=codes.device, dtype=dtype)
    return table[codes.long()]


def fake_quantize(x: torch.Tensor, scale, spec: FormatSpec, **kwargs) -> torch.Tensor:
    """``quantize(x / scale) * scale`` in ``x``'s dtype; ``scale`` broadcasts against ``x``."""
    if _native_fast_path(spec, kwargs):
        q = _native_round(x.float() / scale, spec)
    else:
        q = quantize_values(x.float() / scale, spec, **kwargs)
    return (q * scale).to(x.dtype)


def _native_fast_path(spec, kwargs) -> bool:
    return (torch_dtype(spec) is not None and kwargs.get("rounding") in (None, "nearest_even")
            and spec.rounding == "nearest_even" and kwargs.get("saturate", True)
            and not kwargs.get("nan_to_zero", False))


def _native_round(y: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Round-to-nearest-even saturating cast through torch's float8 dtype (same bits as
    ``quantize_values``, several times faster). Clamps first: only e4m3fn saturates on cast."""
    m = spec.layout.max
    return y.clamp(-m, m).to(torch_dtype(spec)).float()


def to_torch_float8(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Saturating cast to torch's float8 dtype of ``spec`` (clamped first)."""
    dt = torch_dtype(spec)
    if dt is None:
        raise ValueError(f"torch has no dtype for format {spec.name!r}")
    m = spec.layout.max
    return x.float().clamp(-m, m).to(dt)


def codes_as_torch_float8(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Reinterpret uint8 codes as torch's float8 dtype (same bits; no copy)."""
    dt = torch_dtype(spec)
    if dt is None:
        raise ValueError(f"torch has no dtype for format {spec.name!r}")
    return codes.view(dt)
