"""Write a quantized model to disk, atomically.

Two layouts (see ``README.md`` beside this file):

* ``compressed-tensors`` when every quantized module is an ``nn.Linear`` with OCP E4M3 weights
  (and E4M3 or no activation quantization), or int8 weights (and int8 or no activations): the
  format transformers (``CompressedTensorsHfQuantizer``) and vLLM read.
* ``fp8ptq-native`` otherwise: uint8 codes + scales, the formats described in ``fp8ptq.json``.

``fp8ptq.json`` is always written and describes every quantized module.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_dir
from ..errors import Fp8ptqError, NumericsError, UsageError
from ..qexperts import QuantExperts
from ..qmodules import QuantGemm
from ..version import __version__
from .card import command_line
from .card import write as write_card
from .experts_io import checkpoint_keys, ct_problem, ct_tensors, router_modules
from .jsonsafe import dumps, json_safe
from .layout import (CT_FLOAT, CT_INT, CT_MIXED, CT_NAIVE, INDEX_NAME,  # noqa: F401 - re-exported
                     LAYOUT_CT, LAYOUT_NATIVE, META_NAME, WEIGHTS_NAME, ct_type)
from .skeleton import MODULE_KEY, SKELETON_NAME, has_hf_config, module_config
from .taps_io import kv_cache_export, taps_report

SHARD_BYTES = 2 * 1024**3  # split model.safetensors only above this
FORMAT_KEYS = ("name", "bits", "exponent_bits", "mantissa_bits", "bias", "specials", "subnormals",
               "rounding", "max", "torch_dtype", "mx_block")



# ---------------------------------------------------------------------------------------------
# which modules, which layout


def quantized_modules(model: nn.Module) -> list[tuple[str, QuantGemm]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantGemm)]


def quantized_experts(model: nn.Module) -> list[tuple[str, QuantExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantExperts)]


def choose_layout(qmods: list[tuple[str, QuantGemm]]) -> tuple[str, str]:
    """(layout, reason). compressed-tensors needs one 8-bit type throughout (e4m3 or int8, the
    activations the same type or unquantized) and ``nn.Linear`` modules: it quantizes only Linear
    (and Embedding) modules, so e.g. transformers' ``Conv1D`` (GPT-2) would load unquantized,
    i.e. silently wrong, through transformers' default path."""
    types = set()
    for name, q in qmods:
        wt = ct_type(q.weight_format)
        at = ct_type(q.act_format) if q.act_format is not None else wt
        if wt is None or at != wt:
            act = q.act_format.name if q.act_format is not None else "none"
            return LAYOUT_NATIVE, (f"{name}: weight {q.weight_format.name} / activation {act} "
                                   "has no compressed-tensors equivalent")
        if q.kind != "linear":
            return LAYOUT_NATIVE, (f"{name}: a {q.kind} module; compressed-tensors quantizes "
                                   "nn.Linear only")
        if "group" in (q.weight_granularity.name, q.act_granularity):
            return LAYOUT_NATIVE, f"{name}: group / MX scales are written in the native layout"
        types.add(wt)
    if len(types) != 1:
        return LAYOUT_NATIVE, "float and int modules mixed"
    return LAYOUT_CT, f"all quantized modules are nn.Linear with {types.pop()} 8-bit weights"


# ---------------------------------------------------------------------------------------------
# tensors


def _check_scales(name: str, q) -> None:
    pairs = ((("weight_scale", q.weight_scale), ("input_scale", q.input_scale))
             if isinstance(q, QuantGemm) else
             [(f"{p}_{k}", getattr(q, f"{p}_{k}")) for p in q.info.projections
              for k in ("scale", "input_scale")])
    for what, s in pairs:
        if s is None:
            continue
        s = s.detach().float()
        if s.numel() == 0 or not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise NumericsError(f"{name}.{what} has a non-finite or non-positive value; refusing "
                                "to write a checkpoint that would decode to NaN/inf/0")


def tied_quantized(model: nn.Module, qmods) -> list[str]:
    """Quantized modules whose weight tensor is shared with another parameter (e.g. a quantized
    lm_head tied to the input embeddings)."""
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    return [n for n, q in qmods if owners.get(id(q.inner.weight), 0) > 1]


def _plain_state_dict(model: nn.Module, qnames: set[str]) -> dict[str, torch.Tensor]:
    """State dict without the ``QuantGemm`` internals: ``N.inner.X`` -> ``N.X`` (bias etc.);
    the dequantized ``N.inner.weight`` and the ``N.weight_codes/_scale/input_scale`` buffers are
    left out (each layout writes them its own way). Tied aliases are kept once (first name)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    # transformers v5: {tied target: source}, e.g. {"lm_head.weight": "model.embed_tokens.weight"}
    tie_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    for key, t in model.state_dict(keep_vars=False).items():
        mod, _, leaf = key.rpartition(".")
        if mod in qnames and leaf in ("weight_codes", "weight_scale", "input_scale"):
            continue
        if mod.endswith(".inner") or mod == "inner":
            owner = mod[: -len(".inner")] if mod != "inner" else ""
            if owner in qnames:
                if leaf == "weight":
                    continue
                key = f"{owner}.{leaf}" if owner else leaf
        if t is None:
            continue
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if t.numel() and ident in seen:
            # a tied alias (e.g. lm_head.weight = embed_tokens.weight): keep the tie source,
            # like save_pretrained, so transformers' tie_weights restores the target
            kept = seen[ident]
            if kept in tie_targets and key not in tie_targets:
                del out[kept]
                seen[ident] = key
                out[key] = t
            continue
        seen[ident] = key
        out[key] = t
    return out


def _quant_tensors(name: str, q: QuantGemm, layout: str) -> dict[str, torch.Tensor]:
    codes = q.weight_codes.detach()
    scale = q.weight_scale.detach().float()
    if layout == LAYOUT_CT:
        dt = torch.float8_e4m3fn if q.weight_format.is_float else torch.int8
        t = {f"{name}.weight": codes.view(dt), f"{name}.weight_scale": scale}
    else:
        t = {f"{name}.weight_codes": codes, f"{name}.weight_scale": scale}
    if q.input_scale is not None:
        t[f"{name}.input_scale"] = q.input_scale.detach().float().reshape(1)
    return t


def _save_tensors(tensors: dict[str, torch.Tensor], directory: Path) -> list[str]:
    """One ``model.safetensors``, or shards of at most ``SHARD_BYTES`` plus the index, split
    and named by huggingface_hub's ``split_torch_state_dict_into_shards`` (what
    ``save_pretrained`` uses), so every loader finds them."""
    import safetensors.torch as st  # looked up at call time (tests patch save_file)
    from huggingface_hub import split_torch_state_dict_into_shards

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    meta = {"format": "pt"}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=SHARD_BYTES)
    names = []
    for fname, keys in split.filename_to_tensors.items():
        st.save_file({k: tensors[k] for k in keys}, str(directory / fname), metadata=meta)
        names.append(fname)
    if split.is_sharded:
        (directory / INDEX_NAME).write_text(json.dumps(
            {"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2))
        names.append(INDEX_NAME)
    return names


# ---------------------------------------------------------------------------------------------
# configs


def _weight_args(q: QuantGemm) -> dict:
    gran = q.weight_granularity.name
    args = {"num_bits": 8, "type": ct_type(q.weight_format), "symmetric": True,
            "group_size": None, "strategy": gran, "dynamic": False}
    if gran == "block":
        args["block_structure"] = [q.weight_granularity.size, q.weight_granularity.size]
    return args


def _input_args(q: QuantGemm) -> dict | None:
    if q.act_format is None:
        return None
    token = q.act_granularity == "token"
    return {"num_bits": 8, "type": ct_type(q.act_format), "symmetric": True, "group_size": None,
            "strategy": "token" if token else "tensor", "dynamic": token}


def compressed_tensors_config(model: nn.Module, qmods: list[tuple[str, QuantGemm]],
                              kv_cache_scheme: dict | None = None) -> dict:
    """``quantization_config`` for config.json, built from compressed-tensors' own pydantic
    classes (``QuantizationArgs`` / ``QuantizationScheme`` / ``QuantizationConfig``) and
    dumped, so what we write is what compressed-tensors validates and transformers / vLLM
    parse. One config group per distinct scheme; a single group targets the class ``Linear``
    and ignores the Linear modules left unquantized (lm_head, routers...), several groups name
    their modules exactly."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme)

    groups: dict[str, dict] = {}
    members: dict[str, list[str]] = {}
    for name, q in qmods:
        w, a = _weight_args(q), _input_args(q)
        key = json.dumps([w, a], sort_keys=True)
        if key not in groups:
            fmt = CT_NAIVE if a is None else (CT_FLOAT if w["type"] == "float" else CT_INT)
            groups[key] = {"weights": w, "input_activations": a, "format": fmt}
            members[key] = []
        members[key].append(name)
    qnames = {n for n, _ in qmods}
    ignore = [n for n, m in model.named_modules()
              if isinstance(m, nn.Linear) and n not in qnames
              and not any(n == f"{q}.inner" for q in qnames)] + router_modules(model)
    single = len(groups) == 1
    schemes = {
        f"group_{i}": QuantizationScheme(
            targets=["Linear"] if single else list(members[key]),
            weights=QuantizationArgs(**g["weights"]),
            input_activations=None if g["input_activations"] is None else
            QuantizationArgs(**g["input_activations"]))
        for i, (key, g) in enumerate(groups.items())}
    formats = {g["format"] for g in groups.values()}
    config = QuantizationConfig(
        config_groups=schemes, quant_method="compressed-tensors",
        kv_cache_scheme=None if kv_cache_scheme is None else QuantizationArgs(**kv_cache_scheme),
        format=formats.pop() if len(formats) == 1 else CT_MIXED,
        quantization_status="compressed", ignore=ignore)
    out = config.model_dump(mode="json")
    for i, g in enumerate(groups.values()):  # per-group format, as compressed-tensors writes it
        out["config_groups"][f"group_{i}"]["format"] = g["format"]
    return out


def native_quantization_config(tool_version: str) -> dict:
    """A marker transformers does not know: it logs "Unknown quantization type, got fp8ptq" and
    skips it (no crash; ``AutoConfig`` is unaffected); vLLM refuses it. Load with
    ``fp8ptq.load``."""
    return {"quant_method": "fp8ptq", "format": LAYOUT_NATIVE, "version": tool_version,
            "metadata": META_NAME, "load_with": "fp8ptq.load(path)"}


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _config_dict(model: nn.Module, qnames: set[str], directory: Path) -> dict:
    if has_hf_config(model):
        cfg = json.loads(model.config.to_json_string(use_diff=False))
        cfg.pop("quantization_config", None)
    else:  # e.g. a CNN from a .pt file
        cfg = {MODULE_KEY: module_config(model, sorted(qnames), directory)}
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(model).__name__]
    dtype = str(_model_dtype(model)).removeprefix("torch.")
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    return cfg


# ---------------------------------------------------------------------------------------------
# fp8ptq.json


def format_facts(spec) -> dict | None:
    if spec is None:
        return None
    d = spec.describe()
    return {k: d[k] for k in FORMAT_KEYS}


def _module_entry(name: str, q: QuantGemm, report, layout: str) -> dict:
    gran = q.weight_granularity
    static = q.act_format is not None and q.act_granularity != "token"
    entry = {
        "kind": q.kind,
        "class": type(q.inner).__name__,
        "weight_format": format_facts(q.weight_format),
        "act_format": format_facts(q.act_format),
        "weight_granularity": gran.name,
        "block_size": getattr(gran, "size", None) if gran.name in ("block", "group") else None,
        "act_granularity": q.act_granularity if q.act_format is not None else None,
        "act_group_size": q.act_group_size,
        "weight_shape": list(q.inner.weight.shape),
        "weight_codes_shape": list(q.weight_codes.shape),
        "weight_scale_shape": list(q.weight_scale.shape),
        "input_scale": float(q.input_scale.reshape(-1)[0]) if static and
        q.input_scale is not None else None,
        "weight_sqnr_db": None, "input_sqnr_db": None, "weight_amax": None, "input_amax": None,
        "stored_as": ({"weight": f"{q.weight_format.torch_dtype or 'int8'} [out, in]"}
                      if layout == LAYOUT_CT else {"weight_codes": "uint8 [out, in]"}),
    }
    if report is not None:
        entry.update(weight_sqnr_db=report.weight_sqnr_db, input_sqnr_db=report.input_sqnr_db,
                     weight_amax=report.weight_amax, input_amax=report.input_amax)
    else:
        entry["weight_amax"] = float(q.dequantized_weight_2d().abs().max())
    return entry


def experts_entry(q: QuantExperts) -> dict:
    """fp8ptq.json facts of a fused-experts module: its tensors are
    ``NAME.{proj}_codes`` uint8 [E, out, in], ``NAME.{proj}_scale`` float32 [E, ...] and, for
    static activations, ``NAME.{proj}_input_scale`` float32 [E]."""
    gran = q.weight_granularity
    return {
        "kind": "experts",
        "class": type(q.inner).__name__,
        "num_experts": q.num_experts,
        "projections": list(q.info.projections),
        "transposed": q.info.transposed,
        "weight_format": format_facts(q.weight_format),
        "act_format": format_facts(q.act_format),
        "weight_granularity": gran.name,
        "block_size": getattr(gran, "size", None) if gran.name == "block" else None,
        "act_granularity": q.act_granularity if q.act_format is not None else None,
        "codes_shapes": {p: list(q.codes(p).shape) for p in q.info.projections},
        "scale_shapes": {p: list(q.weight_scale(p).shape) for p in q.info.projections},
    }


def _original_bytes(model: nn.Module) -> int:
    """Estimate of the unquantized model: every (unique) parameter in its dtype; the quantized
    GEMM weights count at the dtype of the weights they replaced."""
    total, seen = 0, set()
    for p in model.parameters():
        if p.data_ptr() in seen and p.numel():
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    for _, q in quantized_experts(model):  # the fused weights they replaced, in their dtype
        size = torch.empty((), dtype=q.dtype).element_size()
        total += sum(q.codes(p).numel() for p in q.info.projections) * size
    return total


# ---------------------------------------------------------------------------------------------
# entry point


def save_quantized(result, recipe=None, out_dir=None, *, tokenizer=None,
                   source: dict | None = None, calib: dict | None = None, force: bool = False,
                   tool_version: str | None = None, check=None) -> dict:
    """Write ``result.model`` (its ``QuantGemm`` modules) to ``out_dir`` and return size facts.

    The recorded recipe is ``result.recipe`` (the one the model was quantized with) unless one
    is passed; ``save_quantized(result, out_dir)`` is the short form.

    Everything is written into a temporary sibling directory first and renamed into place only
    when complete; an existing ``out_dir`` is refused unless ``force`` (then it is replaced only
    after the new checkpoint is complete). Nothing partial is ever left behind. ``check``
    (a callable taking the complete temporary folder) runs before the rename: raising there
    writes nothing (``quantize --runtime vllm``).
    """
    if tool_version is None:
        tool_version = __version__
    if out_dir is None and isinstance(recipe, (str, os.PathLike)):
        recipe, out_dir = None, recipe
    if out_dir is None:
        raise UsageError("save_quantized needs an output directory")
    recipe = recipe if recipe is not None else getattr(result, "recipe", None)
    if recipe is None:
        raise UsageError("save_quantized needs the recipe the model was quantized with")
    model = result.model
    out = Path(out_dir).expanduser().absolute()
    if out.exists() or out.is_symlink():
        if not force:
            raise UsageError(f"output directory {out} already exists (use --force to replace it)")
        if not out.is_dir() or out.is_symlink():
            raise UsageError(f"{out} exists and is not a directory; refusing to replace it")
    qmods = quantized_modules(model)
    experts = quantized_experts(model)
    if not qmods and not experts:
        raise UsageError("the model has no quantized (QuantGemm) module to save")
    for name, q in [*qmods, *experts]:
        _check_scales(name, q)
    layout, reason = choose_layout(qmods)
    expert_keys: dict = {}
    if experts and layout == LAYOUT_CT:
        layout, reason, expert_keys = _experts_layout(model, qmods, experts)
        if layout != LAYOUT_CT and hasattr(result, "warnings"):
            result.warnings.append(f"written in the fp8ptq-native layout, not compressed-tensors "
                                   f"(vLLM would not serve it): {reason}")

    with atomic_dir(out, if_exists="replace" if force else "fail") as tmp:
        facts = _write(tmp, model, qmods, layout, reason, result, recipe, tokenizer, source,
                       calib, tool_version, expert_keys)
        if check is not None:
            check(tmp)
    facts["path"] = str(out)
    return facts


def _experts_layout(model, qmods, experts) -> tuple[str, str, dict]:
    """compressed-tensors for fused experts when vLLM's fused-MoE kernels serve their recipe,
    the Linear modules share it and transformers' conversion mapping names the experts."""
    schemes = {(q.weight_granularity.name, q.act_granularity if q.act_format else None)
               for _, q in [*qmods, *experts]}
    keys = {}
    for name, q in experts:
        problem = ct_problem(name, q)
        if problem:
            return LAYOUT_NATIVE, problem, {}
        keys[name] = checkpoint_keys(model, name, q)
        if keys[name] is None:
            return LAYOUT_NATIVE, (f"{name}: transformers has no per-expert checkpoint names for "
                                   "this architecture"), {}
    if len(schemes) != 1:
        return LAYOUT_NATIVE, "experts and Linear modules use different schemes", {}
    return LAYOUT_CT, (f"nn.Linear and {len(experts)} fused-experts modules with e4m3 weights, "
                       "experts under transformers' per-expert checkpoint names"), keys


def _write(tmp: Path, model, qmods, layout, reason, result, recipe, tokenizer, source, calib,
           tool_version, expert_keys=None) -> dict:
    experts = quantized_experts(model)
    qnames = {n for n, _ in qmods} | {n for n, _ in experts}
    tensors = _plain_state_dict(model, qnames)
    for name, q in experts:
        if expert_keys:
            for proj in q.info.projections:
                for leaf in ("codes", "scale", "input_scale"):
                    tensors.pop(f"{name}.{proj}_{leaf}", None)
            tensors.update(ct_tensors(name, q, expert_keys[name]))
    for name, q in qmods:
        tensors.update(_quant_tensors(name, q, layout))
    taps = taps_report(result)
    kv_tensors, kv_scheme, kv_note = kv_cache_export(model, taps, layout)
    files = _save_tensors({**tensors, **kv_tensors}, tmp)

    cfg = _config_dict(model, qnames, tmp)
    if (tmp / SKELETON_NAME).is_file():
        files.append(SKELETON_NAME)
    tied = tied_quantized(model, qmods)
    if tied and cfg.get("tie_word_embeddings"):
        # The shared tensor now holds the dequantized weight and the quantized module keeps its
        # own codes: stored separately, loaded untied (same numbers, no re-tying to the codes).
        cfg["tie_word_embeddings"] = False
    cfg["quantization_config"] = (compressed_tensors_config(model, qmods, kv_scheme)
                                  if layout == LAYOUT_CT
                                  else native_quantization_config(tool_version))
    (tmp / "config.json").write_text(dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(str(tmp))
        except Exception:  # an invalid generation config must not sink the checkpoint
            pass
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))

    weight_bytes = sum((tmp / f).stat().st_size for f in files if f.endswith(".safetensors"))
    original = _original_bytes(model)
    reports = {r.name: r for r in getattr(result, "modules", []) or []}
    sizes = {"checkpoint_bytes": weight_bytes, "original_bytes": original,
             "compression_ratio": (original / weight_bytes) if weight_bytes else None}
    meta = {
        "tool": "fp8ptq",
        "version": tool_version,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "layout": layout,
        "layout_reason": reason,
        "files": files,
        "dtype": cfg["dtype"],
        "architectures": cfg.get("architectures"),
        "source": source or {},
        "recipe": recipe.to_dict() if hasattr(recipe, "to_dict") else recipe,
        "calibration": calib,
        "modules": {n: _module_entry(n, q, reports.get(n), layout) for n, q in qmods},
        "experts": {n: {**experts_entry(q), "checkpoint_keys": (expert_keys or {}).get(n)}
                    for n, q in experts},
        "skipped": list(getattr(result, "skipped", []) or []),
        "untied": tied,
        "warnings": list(getattr(result, "warnings", []) or []),
        "sizes": sizes,
        "taps": taps,
        "kv_cache_scales": kv_note,
        "command": command_line(),
        "extras": {k: v for k, v in (getattr(result, "extras", None) or {}).items()
                   if k != "taps"},
    }
    (tmp / META_NAME).write_text(dumps(meta, indent=2) + "\n")
    write_card(tmp, json_safe(meta), cfg)
    return json_safe({"layout": layout, "files": files, **sizes})
