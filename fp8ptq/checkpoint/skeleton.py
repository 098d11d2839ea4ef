"""Checkpoints of models without a transformers config (CNNs loaded from a ``.pt`` file).

``config.json`` then says how to rebuild the architecture under ``fp8ptq_module``: the built-in
``digits-cnn`` by its constructor arguments, any other module as a weightless pickled skeleton
(``module_skeleton.pt``: the unquantized module tree with its state-dict tensors on the meta
device; non-persistent buffers, which no state dict holds, keep their values). The state-dict
tensors live in ``model.safetensors`` like in every other checkpoint.

Trust: the skeleton is a pickle. It is read like every ``.pt`` file (``fp8ptq.files.safe_pickle``):
without running code from the file when it names only torch.nn layers and built-in classes,
otherwise only with ``trust_pickle`` (``--trust-pickle``). The built-in architecture needs no
pickle at all.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ..errors import DataError, Fp8ptqError, first_line
from ..files.safe_pickle import load_torch_file
from ..model.gemm import set_submodule
from ..vision import BUILTIN_ARCHITECTURE, TinyMobileNet

MODULE_KEY = "fp8ptq_module"
SKELETON_NAME = "module_skeleton.pt"


def has_hf_config(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "to_json_string")


def module_config(model: nn.Module, quantized: list[str], directory: Path) -> dict:
    """Describe ``model``'s architecture for ``config.json``, writing the skeleton file into
    ``directory`` when the architecture is not built in."""

    if type(model) is TinyMobileNet:
        return {"builtin": BUILTIN_ARCHITECTURE, "kwargs": dict(model.arch_kwargs)}
    skeleton = copy.deepcopy(model)
    for name in quantized:  # back to the plain GEMM modules that QuantGemm wraps
        set_submodule(skeleton, name, skeleton.get_submodule(name).inner)
    kept = _non_persistent_buffers(skeleton)
    skeleton.to("meta")
    _set_tensors(skeleton, kept)
    torch.save(skeleton, directory / SKELETON_NAME)
    cls = type(model)
    return {"skeleton": SKELETON_NAME, "class": f"{cls.__module__}.{cls.__qualname__}"}


def build_module(directory: Path, spec: dict, dtype: torch.dtype,
                 trust_pickle: bool = False) -> nn.Module:
    """The unquantized architecture ``spec`` describes, with uninitialised tensors."""

    where = f"{directory}/config.json: {MODULE_KEY}"
    if not isinstance(spec, dict):
        raise DataError(f"{where} is not a JSON object")
    if spec.get("builtin") == BUILTIN_ARCHITECTURE:
        kwargs = spec.get("kwargs", {})
        try:
            return TinyMobileNet(**kwargs).to(dtype)
        except (TypeError, ValueError, RuntimeError) as e:  # arguments that do not fit
            raise DataError(f"{where}: kwargs {kwargs!r} do not build the built-in "
                            f"{BUILTIN_ARCHITECTURE} ({first_line(e)})") from None
    if not isinstance(spec.get("skeleton"), str):
        raise DataError(f"{where} names neither a built-in architecture nor a skeleton file")
    path = directory / spec["skeleton"]
    if not path.is_file():
        raise DataError(f"cannot rebuild {spec.get('class', 'the module')}: {path} is missing")
    skeleton = load_torch_file(path, trust_pickle=trust_pickle, what="module skeleton")
    if not isinstance(skeleton, nn.Module):
        raise Fp8ptqError(f"{path} holds a {type(skeleton).__name__}, not an nn.Module")
    kept = {n: b for n, b in skeleton.named_buffers() if not b.is_meta}
    skeleton.to_empty(device="cpu")
    _set_tensors(skeleton, kept)
    return skeleton.to(dtype)


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    persistent = model.state_dict(keep_vars=True).keys()
    return {n: b.clone() for n, b in model.named_buffers() if n not in persistent}


def _set_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, t)
