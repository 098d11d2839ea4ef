"""Which checkpoint tensors make which model parameter: transformers' loading rules, applied
without loading the model.

transformers 5 does not copy a checkpoint into a model key for key. It renames keys
(``WeightRenaming``, e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``), strips or adds the base
model's prefix, and builds some parameters from several tensors (``WeightConverter``: an MoE
layer's experts, saved one tensor per expert and projection, are stacked and concatenated into
its fused ``gate_up_proj`` / ``down_proj``). ``SourceMap`` runs the rename step that
``from_pretrained`` runs (``transformers.core_model_loading.rename_source_key`` with the model's
``get_model_conversion_mapping``, in transformers' own key order) over the checkpoint's key names
alone; ``realize`` then applies a converter's own operations to the tensors once they are read,
cast to the dtype ``from_pretrained`` gives each parameter. So a parameter built here is the one
``from_pretrained(..., dtype=...)`` builds, bit for bit (tested), and a model type transformers
learns to convert is handled without a table of ours.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    build_glob_alternation,
    dot_natural_key,
    rename_source_key,
)


@dataclass
class Load:
    """The checkpoint tensors (``sources``) that make model state-dict entries ``targets``."""

    targets: list[str]
    sources: list[str] = field(default_factory=list)
    converter: WeightConverter | None = None  # None: one tensor, at most renamed
    patterns: dict[str, str] = field(default_factory=dict)  # source -> converter pattern
    dtype: torch.dtype = torch.float32


class SourceMap:
    """The ``Load`` of every model state-dict entry that ``source_names`` provide; checkpoint
    keys the model does not use are in ``unused`` (``from_pretrained`` ignores them too)."""

    def __init__(self, model: nn.Module, source_names, dtype: torch.dtype):
        self.model = model
        meta = model.state_dict()
        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
        policy = build_glob_alternation(list(plan)) if plan else None
        prefix = getattr(model, "base_model_prefix", None)
        loads: dict[str, Load] = {}
        self.unused: list[str] = []
        for key in sorted(source_names, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if target not in meta and key in meta:  # as from_pretrained: only the prefix
                target, pattern = rename_source_key(key, [], [], prefix, meta)
            if target not in meta:
                self.unused.append(key)
                continue
            load = loads.get(target)
            if load is None:
                conv = deepcopy(by_pattern[pattern]) if pattern is not None else None
                targets = [target] if conv is None else [
                    target.replace(conv.target_patterns[0], t) for t in conv.target_patterns]
                load = loads[target] = Load(targets, converter=conv,
                                            dtype=_dtype(target, meta, dtype, plan, policy))
            load.sources.append(key)
            if pattern is not None:
                load.patterns[key] = pattern
        self.loads = list(loads.values())
        self.by_target = {t: ld for ld in self.loads for t in ld.targets}

    def realize(self, load: Load, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of ``load.targets`` from ``read(source_key)``, as ``from_pretrained``
        would set them."""
        if load.converter is None:
            return {load.targets[0]: read(load.sources[0]).to(load.dtype)}
        conv = deepcopy(load.converter)  # a converter collects its tensors: a fresh one per use
        for key in load.sources:
            conv.add_tensor(load.targets[0], key, load.patterns[key],
                            lambda k=key: read(k).to(load.dtype))
        out = conv.convert(load.targets[0], model=self.model, config=self.model.config)
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


def _dtype(target: str, meta: dict, dtype: torch.dtype, plan: dict, policy) -> torch.dtype:
    """The dtype ``from_pretrained(dtype=dtype)`` loads ``target`` in: the model's fp32 plan
    (``_keep_in_fp32_modules``), else the parameter's own dtype where it differs (buffers)."""
    if policy is not None:
        alt, by_group, _ = policy
        found = alt.search(target)
        if found is not None:
            return plan[by_group[found.lastgroup]]
    empty = meta.get(target)
    return empty.dtype if empty is not None and empty.dtype != dtype else dtype


__all__ = ["Load", "SourceMap"]
