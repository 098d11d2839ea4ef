"""Units of a sensitivity analysis: one GEMM (level "module") or every GEMM of one decoder
layer (level "block"), with the ``--skip`` / ``--override`` glob that selects exactly it."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from torch import nn

from ..errors import UsageError

LEVELS = ("module", "block")


@dataclass
class Unit:
    name: str
    modules: list[str]
    pattern: str  # the --skip / --override glob that selects exactly this unit
    layer: int | None = None  # index in the decoder-layer stack; None: outside it


_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _block(name: str) -> tuple[str, str, int] | None:
    """``model.layers.3.mlp.up_proj`` -> (``model.layers.3``, ``model.layers``, 3)."""
    m = _INDEX.search(name)
    if m is None:
        return None
    return name[:m.end()], name[:m.start(1)].rstrip("."), int(m.group(1))


def layer_stack(model: nn.Module, names: list[str]) -> str | None:
    """The ``nn.ModuleList`` holding most of ``names``: the decoder layers."""
    counts = Counter(b[1] for b in map(_block, names) if b is not None)
    for parent, _ in counts.most_common():
        if isinstance(model.get_submodule(parent), nn.ModuleList):
            return parent
    return None


def group_units(model: nn.Module, names: list[str], level: str) -> list[Unit]:
    if level not in LEVELS:
        raise UsageError(f"granularity level must be one of {', '.join(LEVELS)}, got {level!r}")
    stack = layer_stack(model, names)
    units: dict[str, Unit] = {}
    for name in names:
        block = _block(name)
        layer = block[2] if block is not None and block[1] == stack else None
        if level == "block" and block is not None:
            key = block[0]
            unit = units.setdefault(key, Unit(key, [], f"{key}.*", layer))
            unit.modules.append(name)
        else:
            units[name] = Unit(name, [name], name, layer)
    return list(units.values())
