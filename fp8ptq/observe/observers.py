"""Statistics of GEMM inputs, collected in one calibration pass with bounded memory.

Each observed tensor keeps its running amax, a per-input-channel amax (for SmoothQuant), the
number of elements seen, and a histogram of |x| on a fixed grid: ``SUB_BINS`` linear sub-bins per
power of two from 2^MIN_LOG2 to 2^MAX_LOG2 (an HDR histogram), plus bin 0 for zeros and anything
smaller. The bin index is read straight off the float32 bit pattern (exponent and top mantissa
bits), so histogramming costs a shift, not a log. A fixed grid means batches merge exactly and
every calibrator (max, percentile, MSE, ...) reads the same pass; relative bin widths match
floating-point formats, whose precision is relative.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..runtime import native

SUB_BITS = 5
SUB_BINS = 1 << SUB_BITS
MIN_LOG2, MAX_LOG2 = -40, 40
NUM_BINS = (MAX_LOG2 - MIN_LOG2) * SUB_BINS + 1  # bin 0: zero / below 2^MIN_LOG2
_FIRST = (MIN_LOG2 + 127) << SUB_BITS  # float32 bits >> (23 - SUB_BITS) of 2^MIN_LOG2


def _bounds(offset: float) -> torch.Tensor:
    k = torch.arange(NUM_BINS - 1, dtype=torch.float64)
    octave, sub = torch.div(k, SUB_BINS, rounding_mode="floor"), torch.remainder(k, SUB_BINS)
    return torch.exp2(MIN_LOG2 + octave) * (1 + (sub + offset) / SUB_BINS)


def bin_edges() -> torch.Tensor:
    """Upper edge of every bin (float64, NUM_BINS); bin 0's is 2^MIN_LOG2."""
    return torch.cat([torch.tensor([2.0**MIN_LOG2], dtype=torch.float64), _bounds(1.0)])


def bin_centers() -> torch.Tensor:
    """Representative value of every bin (float64, NUM_BINS); bin 0 stands for zero."""
    return torch.cat([torch.zeros(1, dtype=torch.float64), _bounds(0.5)])


def histogram_index(a: torch.Tensor) -> torch.Tensor:
    """Bin of each non-negative float32 value."""
    idx = (a.view(torch.int32) >> (23 - SUB_BITS)) - (_FIRST - 1)
    return idx.clamp_(0, NUM_BINS - 1)


@dataclass
class TensorStats:
    amax: float = 0.0
    channel_amax: torch.Tensor | None = None  # float32 [channels]
    count: int = 0
    histogram: torch.Tensor = field(default_factory=lambda: torch.zeros(NUM_BINS,
                                                                        dtype=torch.float64))
    nonfinite: int = 0

    def update(self, x: torch.Tensor, channel_dim: int = -1) -> None:
        if self._update_native(x, channel_dim):
            return
        a = x.detach().abs()
        if channel_dim != -1 and channel_dim != a.dim() - 1:
            a = a.movedim(channel_dim, -1)
        a = a.reshape(-1, a.shape[-1]).float()
        ch = a.amax(dim=0)
        if not bool(torch.isfinite(ch).all()):  # rare: pay for the elementwise check only then
            finite = torch.isfinite(a)
            self.nonfinite += int((~finite).sum())
            a = torch.where(finite, a, torch.zeros_like(a))
            ch = a.amax(dim=0)
        ch = ch.cpu()
        self.channel_amax = ch if self.channel_amax is None else torch.maximum(
            self.channel_amax, ch)
        self.amax = max(self.amax, float(ch.max())) if ch.numel() else self.amax
        self.count += a.numel()
        # a scatter into NUM_BINS counters, where bincount's output size would depend on the
        # data (a host sync per batch on a GPU); the same integer counts
        idx = histogram_index(a).reshape(-1)
        counts = torch.zeros(NUM_BINS, dtype=torch.int64, device=idx.device).scatter_add_(
            0, idx.long(), torch.ones_like(idx, dtype=torch.int64))
        self.histogram += counts.cpu().to(torch.float64)

    def _update_native(self, x: torch.Tensor, channel_dim: int) -> bool:
        """``update`` in one pass of the C kernel (same statistics, bit for bit): |x|, channel
        amax, the non-finite check and the histogram read the model's dtype directly, with no
        float32 copy of the activation. False where it does not apply (the torch path runs)."""
        if channel_dim != -1 and channel_dim != x.dim() - 1 or x.dim() == 0 or \
                x.numel() == 0 or not x.is_contiguous() or not native.supports(x):
            return False
        x2 = x.detach().reshape(-1, x.shape[-1])
        ch = torch.zeros(x2.shape[1], dtype=torch.float32)
        counts = torch.zeros(NUM_BINS, dtype=torch.int64)
        self.nonfinite += native.observe(x2, ch, counts, 23 - SUB_BITS, _FIRST)
        self.channel_amax = ch if self.channel_amax is None else torch.maximum(
            self.channel_amax, ch)
        self.amax = max(self.amax, float(ch.max()))
        self.count += x2.numel()
        self.histogram += counts.to(torch.float64)
        return True

    @property
    def zeros(self) -> int:
        return int(self.histogram[0])

    def merge(self, other: TensorStats) -> None:
        self.amax = max(self.amax, other.amax)
        if other.channel_amax is not None:
            self.channel_amax = other.channel_amax.clone() if self.channel_amax is None else \
                torch.maximum(self.channel_amax, other.channel_amax)
        self.count += other.count
        self.histogram += other.histogram
        self.nonfinite += other.nonfinite

    @property
    def seen(self) -> bool:
        return self.count > 0


def sample_rows(x: torch.Tensor, channel_dim: int, stride: int) -> torch.Tensor:
    """Every ``stride``-th row of ``x`` seen as [rows, channels] (deterministic positions, so a
    later pass over the same batch picks the same tokens)."""
    if channel_dim != -1 and channel_dim != x.dim() - 1:
        x = x.movedim(channel_dim, -1)
    return x.reshape(-1, x.shape[-1])[::stride]


class StatsCollector:
    """Forward pre-hooks that feed each module's first input into its ``TensorStats``.

    With ``sample_batches`` > 0 it also keeps, from the first ``sample_batches`` batches, every
    ``row_stride``-th input row of each module: bounded samples for calibrators that measure
    the layer's output error (best-of, power-of-two search, SmoothQuant auto).

    GEMMs that are called one after the other with the very same input tensor (q/k/v, gate/up,
    an MoE's shared expert) are observed once: the later ones share the first one's
    ``TensorStats`` (and samples) instead of repeating abs / amax / histogram on identical data.
    ``aliases`` says who shares whose; statistics are the same as observing each separately.
    """

    def __init__(self, modules: dict[str, nn.Module], channel_dims: dict[str, int] | None = None,
                 sample_batches: int = 0, row_stride: int = 16):
        self.modules = modules
        self.channel_dims = channel_dims or {}
        self.stats = {name: TensorStats() for name in modules}
        self.sample_batches, self.row_stride = sample_batches, row_stride
        # (global batch index, rows): data-parallel ranks see different batches, and gathering
        # their samples must restore the order a single process would have kept them in
        self.samples: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in modules}
        self.batch_index = 0
        self.aliases: dict[str, str] = {}  # module -> module whose statistics it shares
        self._last: tuple | None = None  # (input tensor, name) of the previous observation

    @contextmanager
    def observing(self):
        handles = [m.register_forward_pre_hook(self._hook(name))
                   for name, m in self.modules.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._last = None

    def _shares(self, name: str, x: torch.Tensor) -> bool:
        """True when ``name`` sees the tensor the previous hook observed (and from now on
        shares its statistics); the reference held to that tensor keeps its identity unique."""
        if name in self.aliases:
            return True
        last = self._last
        if last is not None and last[0] is x and last[1] != name and \
                self.channel_dims.get(last[1], -1) == self.channel_dims.get(name, -1) and \
                not self.stats[name].seen:
            owner = self.aliases.get(last[1], last[1])
            self.aliases[name] = owner
            self.stats[name] = self.stats[owner]
            self.samples[name] = self.samples[owner]
            return True
        self._last = (x, name)
        return False

    def _hook(self, name):
        dim = self.channel_dims.get(name, -1)

        def hook(_module, args):
            if args and torch.is_tensor(args[0]):
                if self._shares(name, args[0]):
                    return
                self.stats[name].update(args[0], dim)
                if self.batch_index < self.sample_batches:
                    # a copy, never a view: every ``row_stride``-th row of a float32 input is
                    # a strided view whose storage is the whole input (16x the rows kept, held
                    # for the whole --target-delta / sensitivity run)
                    rows = sample_rows(args[0].detach(), dim, self.row_stride)
                    self.samples[name].append((self.batch_index, rows.to(
                        "cpu", torch.float32, copy=True, memory_format=torch.contiguous_format)))

        return hook

    def next_batch(self) -> None:
        self.batch_index += 1

    def row_samples(self) -> dict[str, torch.Tensor]:
        """Each module's sampled rows in batch order; GEMMs that share an input share one
        tensor (not one copy each)."""
        joined: dict[int, torch.Tensor] = {}
        for rows in self.samples.values():
            if rows and id(rows) not in joined:
                joined[id(rows)] = torch.cat([r for _, r in sorted(rows, key=lambda x: x[0])])
        return {n: joined[id(rows)] for n, rows in self.samples.items() if rows}
