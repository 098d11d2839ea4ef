"""MSE calibration: the clip range that minimises the quantization error in the target format.

Activations: the error of each candidate clip range is computed on the log-histogram of the
calibration pass (bin centres weighted by counts). Weights: computed on the weight itself, per
granularity group, each group picking its own best candidate (``weighted_errors``, which
``hmse`` runs with each input's energy as the weight of its column's errors).
"""

from __future__ import annotations

import math

import torch

from fp8ptq.formats import fake_quantize, quantize_values
from fp8ptq.formats.scales import TINY, divide
from fp8ptq.observe.observers import bin_centers

# Candidate clip ranges as fractions of amax: fine steps near amax, coarser far below.
ACT_RATIOS = torch.exp2(-torch.arange(0, 48) / 8.0)  # 1 .. ~0.016
WEIGHT_RATIOS = torch.linspace(1.0, 0.5, 11)
# elements per row chunk of the weight search: bounds its float32 temporaries (~5 of this size)
CHUNK_ELEMENTS = 1 << 20


def candidate_ratios(fmt, default: torch.Tensor) -> torch.Tensor:
    """Clip-range candidates as multiples of amax (scale = candidate / calibration_max). For
    tapered formats (HiF8) they map amax anywhere from 1 up to the format's max, in
    quarter-octave steps."""
    if not fmt.tapered:
        return default
    lo, hi = -math.log2(fmt.calibration_max), math.log2(fmt.max / fmt.calibration_max)
    return torch.exp2(torch.arange(int(4 * hi), int(4 * lo) - 1, -1) / 4.0)


def _fake_quant(x: torch.Tensor, scale: torch.Tensor, fmt) -> torch.Tensor:
    return quantize_values(x / scale, fmt) * scale


class MseCalibrator:
    name = "mse"

    def __init__(self, ratios: torch.Tensor = ACT_RATIOS):
        self.ratios = ratios

    def amax(self, stats, fmt) -> float:
        if not stats.seen or stats.amax == 0:
            return stats.amax
        counts = stats.histogram
        nz = counts > 0
        centers = bin_centers()[nz].clamp(max=stats.amax).float()
        weights = counts[nz]
        candidates = stats.amax * candidate_ratios(fmt, self.ratios)
        scales = (candidates / fmt.calibration_max).float().unsqueeze(1)
        err = (_fake_quant(centers.unsqueeze(0), scales, fmt) - centers).double().pow(2)
        return float(candidates[int(torch.argmin(err @ weights))])


def weighted_errors(w2d: torch.Tensor, gran, fmt, amax: torch.Tensor, ratios: torch.Tensor,
                    hdiag: torch.Tensor | None = None,
                    chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``[len(ratios), *amax.shape]``: per candidate and scale group, ``sum_j h_j (w - s Q(w /
    s))^2`` with ``s = amax * r / calibration_max`` (the scale ``amax_to_scale`` would make of
    that clip range, bit for bit) and ``h`` the input energies ``hdiag`` (None: all 1, the
    plain squared error; moved to the weight's device, as the Hessian collector keeps its sums
    on the CPU). Row chunks keep the temporaries bounded on big GEMMs."""
    rows, cols = w2d.shape
    h = None
    if hdiag is not None:
        h = hdiag.detach().to(w2d.device, torch.float32).reshape(1, cols).clamp(min=0)
        top = float(h.max()) if h.numel() else 0.0
        if not bool(torch.isfinite(h).all()):
            h = None  # no usable energies: every input counts the same
        elif top > 0:
            h = h / top  # scale-free, no overflow
        # all zero (a GEMM no calibration token reached): every candidate ties, the first stays
    step = gran.row_step
    chunk = max(step, (chunk_elements // max(cols, 1)) // step * step)
    parts = []
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        x = w2d[start:stop].float()
        a = gran.rows(amax, start, stop)
        errs = []
        for r in ratios.tolist():
            scale = divide(a * r, fmt.calibration_max).clamp(min=TINY)
            d = fake_quantize(x, gran.expand(scale, x), fmt).sub_(x).square_()
            if h is not None:
                d.mul_(h)
            errs.append(gran.reduce(d, "sum").double())
        parts.append(torch.stack(errs))
    if gran.name == "tensor":
        return torch.stack(parts).sum(dim=0)
    return torch.cat(parts, dim=1)


def best_amax(amax: torch.Tensor, ratios: torch.Tensor, errors: torch.Tensor) -> torch.Tensor:
    """Per scale group, ``amax`` times the candidate ratio of least error (the first of equal
    ones; NaN errors never win); all-zero / non-finite groups keep ``amax``
    (``amax_to_scale`` guards them)."""
    best = torch.argmin(torch.nan_to_num(errors, nan=float("inf")), dim=0)
    chosen = amax * ratios.to(amax.device, amax.dtype).take(best)
    return torch.where(torch.isfinite(amax) & (amax > 0), chosen, amax)


class MseWeightCalibrator:
    name = "mse"

    def __init__(self, ratios: torch.Tensor = WEIGHT_RATIOS):
        self.ratios = ratios

    def amax(self, w2d: torch.Tensor, granularity, fmt) -> torch.Tensor:
        amax = granularity.amax(w2d)
        if w2d.numel() == 0:
            return amax
        ratios = candidate_ratios(fmt, self.ratios)
        return best_amax(amax, ratios, weighted_errors(w2d, granularity, fmt, amax, ratios))
