"""What goes into a checkpoint besides the quantized tensors: the plain tensors of a model, the
fp8ptq.json entry of each quantized module, config.json, sizes. Pure functions of a model (or a
block of it) and of plain data; the layouts decide the quantized tensors' names and dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import NumericsError
from ..formats import decode
from ..formats.granularity import weight_granularity
from ..nn.quant_experts import ProjectionQuant, QuantExperts
from ..nn.quant_gemm import QuantGemm
from .layouts import GemmQuant, ModuleDesc
from .skeleton import MODULE_KEY, has_hf_config, module_config

FORMAT_KEYS = ("name", "bits", "exponent_bits", "mantissa_bits", "bias", "specials", "subnormals",
               "rounding", "max", "torch_dtype", "mx_block", "mx_scale_rounding")
_QUANT_BUFFERS = ("weight_codes", "weight_scale", "input_scale")  # QuantGemm's own tensors


def gemm_quant(q: QuantGemm) -> GemmQuant:
    """The stored form of a ``QuantGemm`` (codes recovered from its weight, see qmodules)."""
    return GemmQuant(q.weight_codes.detach(), q.weight_scale.detach().float(),
                     None if q.input_scale is None else q.input_scale.detach())


def experts_quant(q: QuantExperts) -> dict[str, ProjectionQuant]:
    return {p: ProjectionQuant(q.codes(p), q.weight_scale(p), q.input_scale(p))
            for p in q.info.projections}


def check_scales(name: str, scales: dict[str, torch.Tensor | None]) -> None:
    """Refuse (``NumericsError``) a scale that would decode to NaN / inf / 0."""
    for what, s in scales.items():
        if s is None:
            continue
        s = s.detach().float()
        if s.numel() == 0 or not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise NumericsError(f"{name}.{what} has a non-finite or non-positive value; refusing "
                                "to write a checkpoint that would decode to NaN/inf/0")


def gemm_scales(q: GemmQuant) -> dict:
    return {"weight_scale": q.weight_scale, "input_scale": q.input_scale}


def experts_scales(projections: dict[str, ProjectionQuant]) -> dict:
    return {f"{p}_{k}": s for p, pq in projections.items()
            for k, s in (("scale", pq.weight_scale), ("input_scale", pq.input_scale))}


def module_scales(module: nn.Module) -> dict:
    """The scales of a ``QuantGemm`` / ``QuantExperts`` by tensor name (no codes computed)."""
    if isinstance(module, QuantExperts):
        return experts_scales(experts_quant(module))
    return {"weight_scale": module.weight_scale, "input_scale": module.input_scale}


def tied_quantized(model: nn.Module, qmods) -> list[str]:
    """Quantized modules whose weight tensor is shared with another parameter (e.g. a quantized
    lm_head tied to the input embeddings)."""
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    return [n for n, q in qmods if owners.get(id(q.inner.weight), 0) > 1]


def plain_tensors(module: nn.Module, quantized: set[str], prefix: str = "",
                  tie_targets=()) -> dict[str, torch.Tensor]:
    """State dict of ``module`` without the quantized modules' own tensors (each layout writes
    those): ``N.inner.X`` -> ``N.X`` (bias etc.), the dequantized ``N.inner.weight`` and the
    codes / scale buffers of ``QuantGemm`` / ``QuantExperts`` left out. ``quantized`` names
    modules relative to ``module``; keys get ``prefix`` (a block's name in the model, with
    its dot). Tied aliases are kept once, as the tie source (``tie_targets``: transformers'
    ``all_tied_weights_keys``), like ``save_pretrained``, so ``tie_weights`` restores them."""
    experts = {n for n, m in module.named_modules() if isinstance(m, QuantExperts)}
    experts_leaves = {f"{p}_{k}" for n in experts
                      for p in module.get_submodule(n).info.projections
                      for k in ("codes", "scale", "input_scale")}
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    tie_targets = set(tie_targets)
    for key, t in module.state_dict(keep_vars=False).items():
        mod, _, leaf = key.rpartition(".")
        if mod in quantized and (leaf in _QUANT_BUFFERS or
                                 (mod in experts and leaf in experts_leaves)):
            continue
        if mod.endswith(".inner") or mod == "inner":
            owner = mod[: -len(".inner")] if mod != "inner" else ""
            if owner in quantized:
                if leaf == "weight":
                    continue
                key = f"{owner}.{leaf}" if owner else leaf
        if t is None:
            continue
        key = prefix + key
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if t.numel() and ident in seen:
            kept = seen[ident]
            if kept in tie_targets and key not in tie_targets:
                del out[kept]
                seen[ident] = key
                out[key] = t
            continue
        seen[ident] = key
        out[key] = t
    return out


def format_facts(spec) -> dict | None:
    if spec is None:
        return None
    d = spec.describe()
    return {k: d[k] for k in FORMAT_KEYS}


def gemm_entry(desc: ModuleDesc, q: GemmQuant, *, module_class: str, weight_shape,
               stored_as: dict, report=None) -> dict:
    """fp8ptq.json entry of one quantized GEMM."""
    entry = {
        "kind": desc.kind,
        "class": module_class,
        "weight_format": format_facts(desc.weight_format),
        "act_format": format_facts(desc.act_format),
        "weight_granularity": desc.weight_granularity,
        "block_size": desc.block_size if desc.weight_granularity in ("block", "group") else None,
        "act_granularity": desc.act_granularity,
        "act_group_size": desc.act_group_size if desc.act_granularity == "group" else None,
        "weight_shape": list(weight_shape),
        "weight_codes_shape": list(q.codes.shape),
        "weight_scale_shape": list(q.weight_scale.shape),
        "input_scale": float(q.input_scale.reshape(-1)[0]) if desc.static_inputs and
        q.input_scale is not None else None,
        "weight_sqnr_db": None, "input_sqnr_db": None, "weight_amax": None, "input_amax": None,
        "stored_as": stored_as,
    }
    if report is not None:
        entry.update(weight_sqnr_db=report.weight_sqnr_db, input_sqnr_db=report.input_sqnr_db,
                     weight_amax=report.weight_amax, input_amax=report.input_amax)
    else:
        w = decode(q.codes, desc.weight_format)
        gran = weight_granularity(desc.weight_granularity, desc.block_size or 128)
        entry["weight_amax"] = float((w * gran.expand(q.weight_scale.float(), w)).abs().max())
    return entry


def experts_entry(desc: ModuleDesc, projections: dict[str, ProjectionQuant], *,
                  module_class: str, extra: dict) -> dict:
    """fp8ptq.json facts of a fused-experts module (``extra``: the layout's own facts)."""
    info = desc.experts
    return {
        "kind": "experts",
        "class": module_class,
        "num_experts": info.num_experts,
        "projections": list(info.projections),
        "transposed": info.transposed,
        "weight_format": format_facts(desc.weight_format),
        "act_format": format_facts(desc.act_format),
        "weight_granularity": desc.weight_granularity,
        "block_size": desc.block_size if desc.weight_granularity == "block" else None,
        "act_granularity": desc.act_granularity,
        "codes_shapes": {p: list(pq.codes.shape) for p, pq in projections.items()},
        "scale_shapes": {p: list(pq.weight_scale.shape) for p, pq in projections.items()},
        **extra,
    }


def original_bytes(model: nn.Module) -> int:
    """Estimate of the unquantized model: every (unique) parameter in its dtype; the quantized
    GEMM weights count at the dtype of the weights they replaced. Works on a model whose
    tensors are on the meta device (a block-by-block or model-free writer's skeleton)."""
    total, seen = 0, set()
    for p in model.parameters():
        key = id(p) if p.is_meta else p.data_ptr()
        if key in seen and p.numel():
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    for _, q in model.named_modules():  # the fused weights they replaced, in their dtype
        if isinstance(q, QuantExperts):
            size = torch.empty((), dtype=q.dtype).element_size()
            total += sum(q.codes(p).numel() for p in q.info.projections) * size
    return total


def model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def config_dict(model: nn.Module, quantized: list[str], directory: Path) -> dict:
    """config.json of the checkpoint (without ``quantization_config``): the model's own config,
    or, for a module without one (a CNN from a .pt file), how to rebuild it (skeleton.py)."""
    if has_hf_config(model):
        cfg = json.loads(model.config.to_json_string(use_diff=False))
        cfg.pop("quantization_config", None)
    else:
        cfg = {MODULE_KEY: module_config(model, sorted(quantized), directory)}
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(model).__name__]
    dtype = str(model_dtype(model)).removeprefix("torch.")
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    return cfg
