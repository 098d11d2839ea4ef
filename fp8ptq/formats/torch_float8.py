"""torch's own float8 dtypes: which formats have one, casts to them and views of codes as them,
and round-to-nearest-even through them or through integer ops on the float32 bits (the codecs'
fast paths, bit-identical to ``codec.quantize_values``)."""

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


def _native_fast_path(spec, kwargs) -> bool:
    return (torch_dtype(spec) is not None and kwargs.get("rounding") in (None, "nearest_even")
            and spec.rounding == "nearest_even" and kwargs.get("saturate", True)
            and not kwargs.get("nan_to_zero", False))


def _native_round(y: torch.Tensor, spec: FormatSpec, keep_dtype: bool = False) -> torch.Tensor:
    """Round-to-nearest-even saturating cast through torch's float8 dtype (same bits as
    ``quantize_values``, several times faster). Clamps first: only e4m3fn saturates on cast."""
    m = spec.layout.max
    q = y.float().clamp(-m, m).to(torch_dtype(spec))
    return q if keep_dtype else q.float()


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


def _bitwise_round(y: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """float32 ``y`` rounded like ``_native_round`` (nearest even, saturating) with integer ops
    on the float bits: about twice as fast on CPU as a float8 cast and back. Normal range:
    round the fp32 mantissa to M bits; subnormal range: a fixed step of 2^(e_min - M)."""
    M, lay = spec.mantissa_bits, spec.layout
    y = y.clamp(-lay.max, lay.max)
    bits = y.view(torch.int32)
    drop = 23 - M
    bits = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & ~((1 << drop) - 1)
    step = lay.min_normal * 2.0 ** -M
    # NaN fails the comparison and takes the subnormal branch, which keeps it NaN
    q = torch.where(y.abs() >= lay.min_normal, bits.view(torch.float32),
                    torch.round(y / step) * step)
    return q if lay.has_negative_zero else q + 0.0  # -0 + 0 = +0
