"""Statistics of GEMM inputs, collected in one calibration pass with bounded memory.

Each observed tensor keeps: its running amax, a per-input-channel amax (for SmoothQuant), the
number of elements seen, and a histogram of |x| on a fixed log2 grid (``BINS_PER_OCTAVE`` bins
per power of two from 2^MIN_LOG2 to 2^MAX_LOG2, plus a bin for exact zeros). A fixed grid means
batches merge exactly and every calibrator (max, percentile, MSE, ...) reads the same pass;
log spacing matches floating-point formats, whose precision is relative.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

BINS_PER_OCTAVE = 32
MIN_LOG2, MAX_LOG2 = -40, 40
NUM_BINS = (MAX_LOG2 - MIN_LOG2) * BINS_PER_OCTAVE


def bin_edges() -> torch.Tensor:
    """Upper edges of the log bins (float64), without the zero bin."""
    k = torch.arange(1, NUM_BINS + 1, dtype=torch.float64)
    return torch.exp2(MIN_LOG2 + k / BINS_PER_OCTAVE)


def bin_centers() -> torch.Tensor:
    """Geometric centre of each log bin (float64), without the zero bin."""
    k = torch.arange(NUM_BINS, dtype=torch.float64) + 0.5
    return torch.exp2(MIN_LOG2 + k / BINS_PER_OCTAVE)


@dataclass
class TensorStats:
    amax: float = 0.0
    channel_amax: torch.Tensor | None = None  # float32 [channels]
    count: int = 0
    zeros: int = 0
    histogram: torch.Tensor = field(default_factory=lambda: torch.zeros(NUM_BINS,
                                                                        dtype=torch.float64))
    nonfinite: int = 0

    def update(self, x: torch.Tensor, channel_dim: int = -1) -> None:
        x = x.detach()
        a = x.abs().float()
        finite = torch.isfinite(a)
        if not bool(finite.all()):
            self.nonfinite += int((~finite).sum())
            a = torch.where(finite, a, torch.zeros_like(a))
        self.amax = max(self.amax, float(a.max())) if a.numel() else self.amax
        ch = a.movedim(channel_dim, -1).reshape(-1, a.shape[channel_dim]).amax(dim=0).cpu()
        self.channel_amax = ch if self.channel_amax is None else torch.maximum(
            self.channel_amax, ch)
        flat = a.reshape(-1)
        self.count += flat.numel()
        nonzero = flat[flat > 0]
        self.zeros += flat.numel() - nonzero.numel()
        pos = (torch.log2(nonzero) - MIN_LOG2) * BINS_PER_OCTAVE
        idx = pos.floor_().clamp_(0, NUM_BINS - 1).long()
        self.histogram += torch.bincount(idx, minlength=NUM_BINS).to(torch.float64).cpu()

    def merge(self, other: "TensorStats") -> None:
        self.amax = max(self.amax, other.amax)
        if other.channel_amax is not None:
            self.channel_amax = other.channel_amax.clone() if self.channel_amax is None else \
                torch.maximum(self.channel_amax, other.channel_amax)
        self.count += other.count
        self.zeros += other.zeros
        self.histogram += other.histogram
        self.nonfinite += other.nonfinite

    @property
    def seen(self) -> bool:
        return self.count > 0


class StatsCollector:
    """Forward pre-hooks that feed each module's first input into its ``TensorStats``."""

    def __init__(self, modules: dict[str, nn.Module], channel_dims: dict[str, int] | None = None):
        self.modules = modules
        self.channel_dims = channel_dims or {}
        self.stats = {name: TensorStats() for name in modules}

    @contextmanager
    def observing(self):
        handles = [m.register_forward_pre_hook(self._hook(name))
                   for name, m in self.modules.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name):
        dim = self.channel_dims.get(name, -1)

        def hook(_module, args):
            if args and torch.is_tensor(args[0]):
                self.stats[name].update(args[0], dim)

        return hook
