"""Fused experts in checkpoints: per-expert tensor names runtimes read, and the recipes they serve.

Hub checkpoints of MoE models store one tensor per expert and projection
(``...block_sparse_moe.experts.3.w1.weight`` for Mixtral, ``...mlp.experts.3.gate_proj.weight``
for Qwen2/Qwen3-MoE and DeepSeek); transformers 5 merges them into its fused 3-D parameters with
the conversion mapping it keeps per model type, and vLLM's MoE loaders read exactly those
per-expert names. So the compressed-tensors layout writes experts under the names transformers'
own mapping gives (read from ``transformers.conversion_mapping``, not from a table of ours):
``NAME.weight`` (float8_e4m3fn rows), ``NAME.weight_scale`` and ``NAME.input_scale`` per expert
and shard. transformers dequantizes and merges them on load; the merged weights equal
fp8ptq's bit for bit (tested).

vLLM's fused-MoE FP8 kernels accept per-tensor weights with static per-tensor activations, or
per-channel weights with dynamic per-token activations (CompressedTensorsW8A8Fp8MoEMethod);
with static activations they use ONE input scale per layer (the largest over the experts). A
recipe outside that set is written in the fp8ptq-native layout (the numbers the user asked
for, loadable with ``fp8ptq.load``) with a warning naming the flags that give a servable
checkpoint; static input scales are unified over the experts of a layer when
``--unify-fused-scales`` is on, so what fp8ptq simulates is what vLLM serves.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .names import ct_type

SERVABLE = {("tensor", "tensor"), ("channel", "token")}


def ct_problem(desc) -> str | None:
    """Why these experts (a ``layouts.ModuleDesc``) cannot be a compressed-tensors (vLLM
    fused-MoE) checkpoint, or None."""
    name = desc.name
    if ct_type(desc.weight_format) != "float" or (desc.act_format is not None
                                                  and ct_type(desc.act_format) != "float"):
        return f"{name}: fused-MoE compressed-tensors checkpoints are e4m3 only"
    if desc.act_format is None:
        return f"{name}: weight-only fused experts have no vLLM FP8 MoE kernel"
    if (desc.weight_granularity, desc.act_granularity) not in SERVABLE:
        return (f"{name}: vLLM's fused-MoE FP8 kernels take per-tensor weights with static "
                "activations or per-channel weights with dynamic per-token activations "
                "(--weight-granularity tensor, or --act-granularity token), not "
                f"{desc.weight_granularity} weights with {desc.act_granularity} activations")
    return None


def _mapping(model_type: str | None):
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return get_checkpoint_conversion_mapping(model_type) or [] if model_type else []


def _patterns(obj, attr) -> list[str]:
    value = getattr(obj, attr, None)
    return [value] if isinstance(value, str) else list(value or [])


def checkpoint_keys(model_type: str | None, desc) -> dict | None:
    """``{proj: [(key with {e}, first row, last row), ...]}``: the per-expert checkpoint keys of
    each projection's shards of experts ``desc`` (a ``layouts.ModuleDesc``) in a model of
    transformers type ``model_type``, from transformers' conversion mapping; None if it has
    none."""
    name = desc.name
    converters, renamings = [], []
    for op in _mapping(model_type):
        (converters if type(op).__name__ == "WeightConverter" else renamings).append(op)
    path = name
    for r in renamings:  # model name -> checkpoint name (the inverse of each renaming)
        for src, tgt in zip(_patterns(r, "source_patterns"), _patterns(r, "target_patterns")):
            if re.fullmatch(r"[\w.]+", src) and re.fullmatch(r"[\w.]+", tgt):
                path = path.replace(tgt, src)
    out = {}
    for proj in desc.experts.projections:
        rows = desc.experts.rows(proj)
        for conv in converters:
            targets = _patterns(conv, "target_patterns")
            if not any(f"{name}.{proj}".endswith(t.lstrip(".")) for t in targets):
                continue
            sources = _patterns(conv, "source_patterns")
            if not all(".*." in s for s in sources) or rows % len(sources):
                return None
            step = rows // len(sources)
            keys = []
            for i, src in enumerate(sources):
                head, _, tail = src.lstrip(".").partition(".*.")
                if not path.endswith(head):
                    return None
                keys.append((f"{path}.{{e}}.{tail}", i * step, (i + 1) * step))
            out[proj] = keys
            break
        else:
            return None
    return out


def ct_tensors(desc, projections: dict, keys: dict) -> dict[str, torch.Tensor]:
    """Per-expert tensors under runtime names from ``projections`` (``{proj:
    ProjectionQuant}``) of experts ``desc``."""
    out = {}
    channel = desc.weight_granularity == "channel"
    for proj, shards in keys.items():
        pq = projections[proj]
        codes, scale, inp = pq.codes, pq.weight_scale, pq.input_scale
        for e in range(desc.experts.num_experts):
            for key, lo, hi in shards:
                k = key.format(e=e)
                w_scale = scale[e][lo:hi] if channel else scale[e]
                out[k] = codes[e, lo:hi].view(torch.float8_e4m3fn).contiguous()
                out[k.removesuffix("weight") + "weight_scale"] = w_scale.float().clone()
                if inp is not None:
                    out[k.removesuffix("weight") + "input_scale"] = inp[e].reshape(1).clone()
    return out


def pop_ct_tensors(tensors: dict, entry: dict) -> dict[str, tuple]:
    """Inverse of ``ct_tensors``: ``{proj: (codes [E,out,in], scale, input_scale or None)}``."""
    out = {}
    channel = entry["weight_granularity"] == "channel"
    for proj, shards in entry["checkpoint_keys"].items():
        codes, scales, inputs = [], [], []
        for e in range(entry["num_experts"]):
            parts, part_scales, part_inputs = [], [], []
            for key, _lo, _hi in shards:
                k = key.format(e=e)
                parts.append(tensors.pop(k).view(torch.uint8))
                part_scales.append(tensors.pop(k.removesuffix("weight") + "weight_scale"))
                part_inputs.append(tensors.pop(k.removesuffix("weight") + "input_scale", None))
            codes.append(torch.cat(parts))
            scales.append(torch.cat(part_scales) if channel else part_scales[0])
            inputs.append(part_inputs[0])
        input_scale = None if inputs[0] is None else torch.cat([i.reshape(1) for i in inputs])
        out[proj] = (torch.stack(codes), torch.stack(scales), input_scale)
    return out


def router_modules(model: nn.Module, experts: list[str]) -> list[str]:
    """Non-expert weight holders next to the fused experts named ``experts`` (routers such as
    ``mlp.gate``): runtimes build them as linear layers, so compressed-tensors' ``ignore`` must
    name them. ``model`` may be on the meta device, its experts wrapped or not."""
    names = []
    for parent in dict.fromkeys(n.rpartition(".")[0] for n in experts):
        module = model.get_submodule(parent)
        for cname, child in module.named_children():
            full = f"{parent}.{cname}" if parent else cname
            w = getattr(child, "weight", None)
            if full not in experts and isinstance(w, torch.Tensor) and w.dim() == 2 and \
                    not isinstance(child, nn.Linear):
                names.append(full)
    return names
