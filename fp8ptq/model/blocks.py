"""The repeated blocks of a model (decoder layers, encoder layers), found generically.

Sequential quantization (``fp8ptq.execution.streaming``) loads, calibrates and quantizes one block
at a time. Rather than a table of architecture names (``model.layers``, ``transformer.h``,
``model.decoder.layers``, ``encoder.layer``, ...), the blocks are the longest ``nn.ModuleList``
whose children all share one class: every transformer stacks its layers that way, and nothing
else in it is as long and uniform.
"""

from __future__ import annotations

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
