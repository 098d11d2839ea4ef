"""Granularities as small classes: how a tensor is grouped for one scale per group.

Weights are handled as 2-D ``[out, in]`` matrices (see ``fp8ptq.model.gemm``); activations as
``[..., features]``. ``amax`` reduces to the granularity's scale shape, ``expand`` broadcasts a
scale of that shape back over the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PerTensor:
    name = "tensor"

    def reduce(self, t: torch.Tensor, how: str) -> torch.Tensor:
        return getattr(t.float(), how)().reshape(1)

    def amax(self, w: torch.Tensor) -> torch.Tensor:
        # in the weight's own dtype, then float32: max is exact, and a bf16 weight needs no
        # float32 copy of itself
        return w.abs().amax().float().reshape(1)

    def expand(self, scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return scale.reshape([1] * w.dim())

    row_step = 1  # rows of a 2-D weight that ``rows`` can start at a multiple of

    def rows(self, scale: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The part of ``scale`` that covers rows ``start:stop`` of the weight (for ``expand``
        on that row slice)."""
        return scale


@dataclass(frozen=True)
class PerChannel:
    """One scale per output channel (row of the 2-D weight)."""

    name = "channel"

    def reduce(self, t: torch.Tensor, how: str) -> torch.Tensor:
        return getattr(t.float(), how)(dim=1, keepdim=True)

    def amax(self, w: torch.Tensor) -> torch.Tensor:
        return w.abs().amax(dim=1, keepdim=True).float()

    def expand(self, scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return scale.reshape(-1, 1)

    row_step = 1

    def rows(self, scale: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return scale.reshape(-1, 1)[start:stop]


@dataclass(frozen=True)
class PerBlock:
    """One scale per ``size x size`` tile of the 2-D weight (edge tiles may be partial)."""

    size: int = 128
    name = "block"

    def grid(self, w: torch.Tensor) -> tuple[int, int]:
        return math.ceil(w.shape[0] / self.size), math.ceil(w.shape[1] / self.size)

    def reduce(self, t: torch.Tensor, how: str) -> torch.Tensor:
        rows, cols = self.grid(t)
        padded = torch.zeros(rows * self.size, cols * self.size, dtype=torch.float32,
                             device=t.device)
        padded[: t.shape[0], : t.shape[1]] = t  # zero padding is neutral for amax of |w| and sums
        tiles = padded.reshape(rows, self.size, cols, self.size)
        return getattr(tiles, how)(dim=(1, 3))

    def amax(self, w: torch.Tensor) -> torch.Tensor:
        return self.reduce(w.abs(), "amax")

    def expand(self, scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        full = scale.repeat_interleave(self.size, 0).repeat_interleave(self.size, 1)
        return full[: w.shape[0], : w.shape[1]]

    @property
    def row_step(self) -> int:
        return self.size

    def rows(self, scale: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return scale[start // self.size: math.ceil(stop / self.size)]


@dataclass(frozen=True)
class PerToken:
    """Dynamic activation scales: one per token (row over the last dim), computed at run time."""

    name = "token"

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().amax(dim=-1, keepdim=True).float()

    def expand(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return scale


@dataclass(frozen=True)
class PerGroup:
    """Dynamic activation scales: one per ``size`` consecutive features of each token (the
    last dim, i.e. the GEMM reduction dim), as FP8_BLOCK's ``group_size: 128`` activations and
    MX's 32-value blocks. A partial last group covers the remaining features."""

    size: int = 128
    name = "group"

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        pad = (-n) % self.size
        a = x.abs().float()
        if pad:  # zeros are neutral for amax of |x|
            a = torch.cat([a, a.new_zeros(*a.shape[:-1], pad)], dim=-1)
        return a.reshape(*a.shape[:-1], -1, self.size).amax(dim=-1)

    def expand(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return scale.repeat_interleave(self.size, dim=-1)[..., : x.shape[-1]]


WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
ACT_GRANULARITIES = ("tensor", "token")  # "group" (PerGroup) is not wired into QuantGemm yet


def weight_granularity(name: str, block_size: int = 128):
    return {"tensor": PerTensor(), "channel": PerChannel(), "block": PerBlock(block_size)}[name]
