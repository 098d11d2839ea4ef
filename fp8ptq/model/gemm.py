"""The GEMMs of a model: which modules count, and their weights as 2-D ``[out, in]`` matrices."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator

import torch
from torch import nn

try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = ()

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
GEMM_TYPES = (nn.Linear, *CONV_TYPES) + ((Conv1D,) if Conv1D else ())


def is_gemm(module: nn.Module) -> bool:
    return isinstance(module, GEMM_TYPES)


def kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if Conv1D and isinstance(module, Conv1D):
        return "conv1d_hf"
    if isinstance(module, CONV_TYPES):
        return "depthwise_conv" if is_depthwise(module) else "conv"
    raise TypeError(f"not a GEMM module: {type(module).__name__}")


def is_depthwise(module: nn.Module) -> bool:
    return isinstance(module, CONV_TYPES) and module.groups > 1 and \
        module.groups == module.in_channels


def weight_2d(module: nn.Module, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as ``[out_features, in_features]`` (a view where the layout allows).
    ``weight``: a tensor in the module's own layout to use instead of ``module.weight`` (the
    model-free path reads it from the checkpoint; the module holds none)."""
    w = module.weight if weight is None else weight
    if Conv1D and isinstance(module, Conv1D):
        return w.t()  # transformers' Conv1D stores [in, out]
    return w.reshape(w.shape[0], -1)


def weight_from_2d(module: nn.Module, w2d: torch.Tensor) -> torch.Tensor:
    """Inverse of ``weight_2d``: back to the module's own weight layout."""
    if Conv1D and isinstance(module, Conv1D):
        return w2d.t().contiguous()
    return w2d.reshape(module.weight.shape)


def input_channel_dim(module: nn.Module) -> int:
    """Which dim of the module's input holds its input features/channels."""
    return 1 if isinstance(module, CONV_TYPES) else -1


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def find_gemms(model: nn.Module, skip=()) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every GEMM whose name matches none of the ``skip`` globs."""
    for name, module in model.named_modules():
        if is_gemm(module) and not matches(name, skip):
            yield name, module


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
