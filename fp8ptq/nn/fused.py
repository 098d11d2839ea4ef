"""GEMMs that runtimes fuse into one (q/k/v, gate/up): one weight scale and one input scale
per fused group, chosen before rounding so that what fp8ptq simulates is what vLLM serves."""

from __future__ import annotations

import torch
from torch import nn

from ..formats.weight_quant import choose_scale
from ..model.gemm import weight_2d

# Shards that runtimes fuse into one GEMM (vLLM's ``packed_modules_mapping``: qkv_proj,
# gate_up_proj; BERT's query/key/value): siblings under one parent module.
FUSED_SHARDS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                ("query", "key", "value"))


def fused_groups(names: list[str]) -> list[list[str]]:
    """Groups of quantized modules that a runtime fuses into one GEMM, by sibling names."""
    present = set(names)
    parents = sorted({n.rpartition(".")[0] for n in names})
    groups = []
    for parent in parents:
        for shards in FUSED_SHARDS:
            members = [f"{parent}.{s}" if parent else s for s in shards]
            if all(m in present for m in members):
                groups.append(members)
    return groups


def unify_fused(recipe, targets: list) -> bool:
    """``--unify-fused-scales``; by default on when the checkpoint can be compressed-tensors
    (e4m3 or int8 weights), i.e. when a runtime will fuse the shards."""
    if recipe.unify_fused_scales is not None:
        return recipe.unify_fused_scales
    return bool(targets) and all(t.weight_format.compressed_tensors_type is not None
                                 for t in targets)


def unified_weight_scales(targets, groups, gran, w_calib, recipe, chosen,
                          weights: dict | None = None) -> dict:
    """Per-tensor weight scales shared by each group of fused shards: vLLM runs q/k/v (gate/up)
    as one GEMM with one weight scale and requantizes every shard to the largest one at load
    time, rounding the weights twice; choosing the shared (largest) scale here, before the
    weights are rounded, makes what fp8ptq simulates exactly what vLLM serves."""
    if gran.name != "tensor" or not groups:
        return {}
    by_name = {t.name: t for t in targets}
    out = {}
    for group in groups:
        scales = []
        for name in group:
            t = by_name[name]
            c = chosen.get(name)
            if c is not None and c.weight_scale is not None:
                scales.append(c.weight_scale.reshape(-1).float())
                continue
            w2d = weight_2d(t.module, (weights or {}).get(name)).detach()
            scales.append(choose_scale(w2d, t.weight_format, gran, w_calib,
                                       pow2=recipe.scale_pow2).reshape(-1))
        shared = torch.stack(scales).max(dim=0).values
        out.update({name: shared.clone() for name in group})
    return out


def unify_input_scales(model: nn.Module, groups: list[list[str]], reports) -> list[dict]:
    """One static input scale per fused group (the largest: what vLLM uses for the fused
    GEMM). With statistics-based calibrators the shards saw the same input and already agree;
    layer-output-aware ones may pick differently per shard."""
    by_name = {r.name: r for r in reports}
    out = []
    for group in groups:
        qs = [model.get_submodule(n) for n in group]
        scales = [q.input_scale for q in qs if q.input_scale is not None]
        entry = {"modules": group, "input_scales_agreed": True}
        if len(scales) == len(qs):
            shared = torch.stack([s.reshape(()) for s in scales]).max()
            entry["input_scales_agreed"] = all(bool(s.reshape(()) == shared) for s in scales)
            for n, q in zip(group, qs):
                q.input_scale.fill_(shared)
                by_name[n].input_scale = float(shared)
        entry["weight_scale"] = [float(q.weight_scale.max()) for q in qs]
        out.append(entry)
    return out
