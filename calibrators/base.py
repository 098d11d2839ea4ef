"""The calibrator interface: statistics in, clip range (amax) out.

Activation calibrators read a ``TensorStats`` from the single calibration pass; weight
calibrators read the weight itself (grouped by a granularity). Both return amax; turning amax
into a scale is ``fp8ptq.formats.scales``' job, so every calibrator gets the same guards.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fp8ptq.formats import FormatSpec
from fp8ptq.observe.observers import TensorStats


class ActivationCalibrator(Protocol):
    name: str

    def amax(self, stats: TensorStats, fmt: FormatSpec) -> float: ...


class WeightCalibrator(Protocol):
    """``w2d``: the ``[out, in]`` weight in its own dtype (bf16 weights are not copied to
    float32 first; convert where the arithmetic needs it). Returns float32 amax in the
    granularity's shape."""

    name: str

    def amax(self, w2d: torch.Tensor, granularity, fmt: FormatSpec) -> torch.Tensor: ...
