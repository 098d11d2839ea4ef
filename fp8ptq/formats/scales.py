"""From clip range (amax) to scale, with the guards every scale goes through.

scale = amax / format.calibration_max: the clip range maps onto the format's largest finite value
(or, for tapered formats like HiF8, onto the top of its full-precision range). A scale
is always finite and > 0: an all-zero tensor, a module that saw no calibration tokens or a
non-finite amax gets scale 1 and a warning.
"""

from __future__ import annotations

import torch

from ..observe.observers import bin_centers
from . import FormatSpec, quantize_values
from .mx import mx_scale

TINY = torch.finfo(torch.float32).tiny


def divide(t: torch.Tensor, number: float) -> torch.Tensor:
    """``t / number``, correctly rounded on every device. CUDA divides a tensor by a Python
    number (a host scalar) as a multiplication by its reciprocal, which can land one ulp off
    the quotient the CPU computes; a scale one ulp apart moves codes that sit on a rounding
    tie, so a checkpoint quantized on a GPU would differ from the CPU's. A divisor on the
    tensor's own device takes the true division on both."""
    t = t.float() if not t.is_floating_point() else t
    return t / torch.full((), number, dtype=t.dtype, device=t.device)


def amax_to_scale(amax, fmt: FormatSpec, *, pow2: bool = False, what: str = "tensor",
                  warnings: list[str] | None = None) -> torch.Tensor:
    """MX formats (``fmt.mx_block``) take the OCP MX v1.0 rule instead: the E8M0 power of two
    ``2^(floor(log2 amax) - emax_elem)`` (all-zero blocks: 2^-127, the spec's smallest)."""
    if fmt.mx_block is not None:
        return mx_scale(torch.as_tensor(amax, dtype=torch.float32), fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32).clone()
    bad = ~torch.isfinite(amax) | (amax <= 0)
    if bool(bad.any()):
        if warnings is not None:
            warnings.append(f"{what}: {int(bad.sum())} of {amax.numel()} scale group(s) had "
                            "amax 0 or non-finite (all-zero, constant or never seen); scale 1 used")
        amax = torch.where(bad, torch.full_like(amax, fmt.calibration_max), amax)
    scale = divide(amax, fmt.calibration_max).clamp(min=TINY)
    if pow2:
        # Perez et al. 2023: a power-of-two scale is an exponent-bias shift. Round up so
        # nothing clips.
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


SQNR_ELEMENTS = 1 << 22  # values per piece of ``sqnr_db``'s sums (32 MB in float64)


def sqnr_db(x: torch.Tensor, xq: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when exact). The sums are float64, taken
    over pieces of about ``SQNR_ELEMENTS`` values: whole-tensor float64 copies of a weight
    (three of them, 1.4 GB for an 8B ``down_proj``) were the largest temporaries a GPU
    quantize made."""
    x, xq = x.reshape(-1), xq.reshape(-1)
    noise = signal = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, x.numel(), SQNR_ELEMENTS):
        a = x[start:start + SQNR_ELEMENTS].double()
        noise = noise + (a - xq[start:start + SQNR_ELEMENTS].double()).pow_(2).sum()
        signal = signal + a.pow_(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(signal / noise)) if signal > 0 else float("-inf")


def histogram_sqnr_db(stats, scale: float, fmt: FormatSpec) -> float:
    """SQNR of quantizing the distribution recorded in ``stats`` with ``scale`` (log-bin centres
    stand in for the values of each bin)."""
    counts = stats.histogram
    nz = counts > 0
    if not bool(nz.any()):
        return float("nan")
    c = bin_centers()[nz].clamp(max=max(stats.amax, TINY))
    q = quantize_values((c / scale).float(), fmt).double() * scale
    noise = ((q - c) ** 2 * counts[nz]).sum()
    signal = (c**2 * counts[nz]).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(signal / noise))


def dynamic_scale(amax: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    """Scales computed at run time (per token / per group activations): the same rule as a
    calibrated scale -- amax onto ``calibration_max`` (the format's max; the top of the
    full-precision range for tapered HiF8), or MX's E8M0 rule -- without warnings: a row of
    zeros gets the smallest positive scale and quantizes to zeros."""
    if fmt.mx_block is not None:
        return mx_scale(amax, fmt, strict=False)
    return divide(amax.float(), fmt.calibration_max).clamp(min=TINY)
