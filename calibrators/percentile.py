"""Percentile calibration: clip at the p-th percentile of |x| (from the log histogram)."""

from __future__ import annotations

import torch

from fp8ptq.observe.observers import bin_edges


class PercentileCalibrator:
    name = "percentile"

    def __init__(self, percentile: float = 99.99):
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile

    def amax(self, stats, fmt) -> float:
        if not stats.seen:
            return 0.0
        target = stats.count * self.percentile / 100.0
        if stats.zeros >= target:
            return stats.amax
        cumulative = torch.cumsum(stats.histogram, 0)
        idx = int(torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64)))
        idx = min(idx, len(cumulative) - 1)
        return min(float(bin_edges()[idx]), stats.amax)
