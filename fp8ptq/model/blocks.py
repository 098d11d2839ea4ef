"""The repeated blocks of a model (decoder layers, encoder layers), found generically.

Sequential quantization (``fp8ptq.execution.streaming``) loads, calibrates and quantizes one block
at a time. Rather than a table of architecture names (``model.layers``, ``transformer.h``,
``model.decoder.layers``, ``encoder.layer``, ...), the blocks are the longest ``nn.ModuleList``
whose children all share one class: every transformer stacks its layers that way, and nothing
else in it is as long and uniform.
"""

from __future__ import annotations

import torch
from torch import nn


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(qualified name, ModuleList) of the repeated blocks, or None when the model has none.
    Ties go to the first list met in module order (the outermost stack)."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 1:
            continue
        classes = {type(child) for child in module}
        if len(classes) != 1:
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    return best


def block_prefix(list_name: str, index: int) -> str:
    """Qualified-name prefix of block ``index`` (``model.layers.3.``)."""
    return f"{list_name}.{index}." if list_name else f"{index}."


def place(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Every parameter and buffer of ``module`` moved to ``device`` (``"meta"``: dropped, the
    memory freed), each module's tensor replaced in its slot rather than swapped in place as
    ``Module.to`` does for tensor subclasses (which refuses a tensor something holds a weak
    reference to; the fake-CUDA tests' tensors are such). A parameter shared by two modules
    (tied weights) stays one parameter."""
    device = torch.device(device)
    moved: dict[int, torch.Tensor] = {}

    def new(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            value = (torch.empty_like(t, device=device) if device.type == "meta"
                     else t.detach().to(device))
            if isinstance(t, nn.Parameter):
                value = nn.Parameter(value, requires_grad=t.requires_grad)
            moved[id(t)] = value
        return moved[id(t)]

    for m in module.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in slots.items():
                if t is not None and t.device != device:
                    slots[name] = new(t)
    return module
