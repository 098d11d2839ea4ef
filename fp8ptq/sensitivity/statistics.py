"""Statistics of a GEMM's weight and input (from the calibration histogram), per format the
scales and SQNRs ``quantize`` would give, and noise-to-signal ratios <-> dB."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..observe.observers import bin_centers


@dataclass
class TensorSummary:
    amax: float
    rms: float
    outlier_ratio: float
    kurtosis: float
    channel_ratio: float | None = None
    count: int = 0


@dataclass
class FormatStats:
    weight_scale_min: float
    weight_scale_max: float
    weight_sqnr_db: float
    input_scale: float | None
    input_sqnr_db: float | None
    output_sqnr_db: float | None
    act_calib: str | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class ModuleStats:
    name: str
    kind: str
    unit: str
    weight: TensorSummary
    input: TensorSummary | None
    formats: dict[str, FormatStats] = field(default_factory=dict)


def _summary(amax: float, m2: float, m4: float, count: int, channel_ratio=None) -> TensorSummary:
    rms = math.sqrt(m2)
    return TensorSummary(amax=amax, rms=rms, outlier_ratio=amax / rms if rms > 0 else math.nan,
                         kurtosis=m4 / (m2 * m2) if m2 > 0 else math.nan,
                         channel_ratio=channel_ratio, count=count)


def summarize_weight(w2d: torch.Tensor) -> TensorSummary:
    w = w2d.detach().double()
    m2 = float(w.pow(2).mean())
    return _summary(float(w.abs().max()), m2, float(w.pow(4).mean()), w.numel())


def summarize_input(stats) -> TensorSummary | None:
    """From a ``TensorStats`` histogram; None if the module saw no calibration tokens."""
    if stats is None or not stats.seen:
        return None
    counts = stats.histogram
    c = bin_centers().clamp(max=max(stats.amax, 0.0))
    total = float(counts.sum())
    m2 = float((c.pow(2) * counts).sum()) / total
    m4 = float((c.pow(4) * counts).sum()) / total
    ch = stats.channel_amax
    median = float(ch.median()) if ch is not None and ch.numel() else 0.0
    ratio = float(ch.max()) / median if median > 0 else None
    return _summary(stats.amax, m2, m4, stats.count, ratio)


def _nsr(db: float | None) -> float:
    """Noise-to-signal power ratio of an SQNR in dB: 0 for None (not quantized); an SQNR that
    could not be computed (NaN) counts as all noise."""
    if db is None:
        return 0.0
    return math.inf if math.isnan(db) else 10 ** (-db / 10)


def _db(nsr: float) -> float:
    if nsr <= 0:
        return math.inf
    return -10 * math.log10(nsr) if math.isfinite(nsr) else -math.inf
