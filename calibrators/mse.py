"""MSE calibration: the clip range that minimises the quantization error in the target format.

Activations: the error of each candidate clip range is computed on the log-histogram of the
calibration pass (bin centres weighted by counts). Weights: computed on the weight itself, per
granularity group, each group picking its own best candidate.
"""

from __future__ import annotations

import math

import torch

from fp8ptq.formats import quantize_values
from fp8ptq.observers import bin_centers

# Candidate clip ranges as fractions of amax: fine steps near amax, coarser far below.
ACT_RATIOS = torch.exp2(-torch.arange(0, 48) / 8.0)  # 1 .. ~0.016
WEIGHT_RATIOS = torch.linspace(1.0, 0.5, 11)


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


class MseWeightCalibrator:
    name = "mse"

    def __init__(self, ratios: torch.Tensor = WEIGHT_RATIOS):
        self.ratios = ratios

    def amax(self, w2d: torch.Tensor, granularity, fmt) -> torch.Tensor:
        w = w2d.float()
        amax = granularity.amax(w)
        best_err, best = None, amax.clone()
        for r in candidate_ratios(fmt, self.ratios).tolist():
            scale = (amax * r / fmt.calibration_max).clamp(min=torch.finfo(torch.float32).tiny)
            err = granularity.reduce((_fake_quant(w, granularity.expand(scale, w), fmt) - w)
                                     .pow(2), "sum")
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, amax * r, best)
        return best
