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
