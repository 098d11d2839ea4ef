"""Max calibration: the clip range is the largest magnitude seen."""

from __future__ import annotations

import torch


class MaxCalibrator:
    name = "max"

    def amax(self, stats, fmt) -> float:
        return stats.amax


class MaxWeightCalibrator:
    name = "max"

    def amax(self, w2d: torch.Tensor, granularity, fmt) -> torch.Tensor:
        return granularity.amax(w2d)


class CastCalibrator:
    """Direct cast, no calibration: scale 1 (Luo et al.'s 'direct-cast', Sun et al.'s
    trans-precision inference)."""

    name = "cast"

    def amax(self, stats_or_w, *args):
        fmt = args[-1]
        if torch.is_tensor(stats_or_w):  # weights: one value per granularity group
            return torch.full_like(args[0].amax(stats_or_w), fmt.calibration_max)
        return fmt.calibration_max
