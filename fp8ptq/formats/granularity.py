"""Granularities as small classes: how a tensor is grouped for one scale per group.

Weights are handled as 2-D ``[out, in]`` matrices (see ``fp8ptq.model.gemm``); activations as
``[..., features]``. ``amax`` reduces to the granularity's scale shape, ``expand`` broadcasts a
scale of that shape back over the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime import native


@dataclass(frozen=True)
class PerTensor:
    name = "tensor"

    def reduce(self, t: torch.Tensor, how: str) -> torch.Tensor:
        return getattr(t.float(), how)().reshape(1)

    def amax(self, w: torch.Tensor) -> torch.Tensor:
        # in the weight's own dtype, then float32: max is exact, and a bf16 weight needs no
        # float32 copy of itself (nor, through the C kernel, an |w| copy)
        rows = native.row_absmax(w)
        return w.abs().amax().float().reshape(1) if rows is None else rows.max().reshape(1)

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
        rows = native.row_absmax(w)  # one pass, no |w| copy; NaN as torch's amax
        return w.abs().amax(dim=1, keepdim=True).float() if rows is None else rows.reshape(-1, 1)

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
        # at every forward of a dynamic GEMM: one pass of the C kernel, no |x| copy
        rows = native.row_absmax(x.reshape(-1, x.shape[-1])) \
            if x.dim() >= 1 and x.is_contiguous() else None
        if rows is None:
            return x.abs().amax(dim=-1, keepdim=True).float()
        return rows.reshape(*x.shape[:-1], 1)

    def expand(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return scale


@dataclass(frozen=True)
class PerGroup:
    """One scale per ``size`` consecutive values along the last dim -- the GEMM reduction dim:
    the features of each token for activations (FP8_BLOCK's dynamic ``group_size: 128``), the
    input columns of each output row for 2-D weights (MX's 32-value blocks). A partial last
    group covers the remaining values; padding with zeros is neutral for amax and sums."""

    size: int = 128
    name = "group"

    def _groups(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as ``[..., n_groups, size]``, float32, zero-padded."""
        pad = (-t.shape[-1]) % self.size
        t = t.float()
        if pad:
            t = torch.cat([t, t.new_zeros(*t.shape[:-1], pad)], dim=-1)
        return t.reshape(*t.shape[:-1], -1, self.size)

    def reduce(self, t: torch.Tensor, how: str) -> torch.Tensor:
        return getattr(self._groups(t), how)(dim=-1)

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        # dynamic activations: at every forward, one pass of the C kernel without a copy
        if x.dim() >= 1 and x.is_contiguous():
            groups = native.row_absmax(x.reshape(-1, x.shape[-1]), self.size)
            if groups is not None:
                return groups.reshape(*x.shape[:-1], -1)
        return self.reduce(x.abs(), "amax")

    def expand(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return scale.repeat_interleave(self.size, dim=-1)[..., : x.shape[-1]]

    row_step = 1  # a 2-D weight's scales are [rows, groups]: any row slice has its own

    def rows(self, scale: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return scale[start:stop]


WEIGHT_GRANULARITIES = ("tensor", "channel", "block")  # recipe choices ("group": MX formats)
# tensor: static calibrated; token / group: dynamic, computed per token / per group at run time
ACT_GRANULARITIES = ("tensor", "token", "group")
DYNAMIC_GRANULARITIES = ("token", "group")


def weight_granularity(name: str, block_size: int = 128):
    """``block_size``: the tile edge of "block", the group length (along K) of "group"."""
    if name == "group":
        return PerGroup(block_size)
    return {"tensor": PerTensor(), "channel": PerChannel(), "block": PerBlock(block_size)}[name]


def act_granularity(name: str, group_size: int = 128):
    """The activation granularity object: ``PerTensor`` (static), ``PerToken``, ``PerGroup``."""
    return {"tensor": PerTensor(), "token": PerToken(), "group": PerGroup(group_size)}[name]
