"""Load a checkpoint written by ``save_quantized`` back into a model with ``QuantGemm`` modules.

Works for both layouts: the architecture is rebuilt from config.json (its
``quantization_config`` removed), the plain tensors are loaded, and every module listed in
``fp8ptq.json`` is wrapped in a ``QuantGemm`` built from the stored codes and scales, so the
reloaded model computes exactly what the in-memory quantized model did.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from ..errors import DataError, Fp8ptqError, UsageError
from ..files.json_files import read_json
from ..formats.granularity import weight_granularity
from ..model.auto import LoadedModel, model_class
from ..model.experts import experts_info
from ..model.gemm import kind as gemm_kind
from ..model.gemm import set_submodule, weight_2d
from ..nn.quant_experts import ProjectionQuant, QuantExperts
from ..nn.quant_gemm import QuantGemm
from .layouts import get_layout, names
from .names import INDEX_NAME, META_NAME, WEIGHTS_NAME  # noqa: F401 - re-exported
from .skeleton import MODULE_KEY, build_module
from .taps_io import install_taps, pop_kv_tensors
from .verify import format_from_facts, verify_checkpoint, weight_files  # noqa: F401


def read_metadata(path) -> dict:
    """The parsed ``fp8ptq.json`` of checkpoint folder ``path``."""
    p = Path(path).expanduser()
    meta_file = p / META_NAME
    if not meta_file.is_file():
        raise UsageError(f"{path} is not an fp8ptq checkpoint (no {META_NAME})")
    meta = read_json(meta_file, expect=None)
    if not isinstance(meta, dict) or not isinstance(meta.get("modules", {}), dict):
        raise DataError(f"{meta_file} is not an fp8ptq checkpoint description")
    if meta.get("tool") != "fp8ptq" or meta.get("layout") not in names():
        raise UsageError(f"{meta_file} is not an fp8ptq checkpoint description")
    return meta


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise DataError(f"{path} is missing")
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise DataError(f"{path}: corrupt or truncated safetensors file ({e})") from None


def _load_tensors(p: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in weight_files(p):
        tensors.update(_load_file(file))
    return tensors


def _read_config(p: Path) -> dict:
    return read_json(p / "config.json")


def _build_model(p: Path, dtype: torch.dtype, trust_pickle: bool = False) -> nn.Module:
    raw = _read_config(p)
    if MODULE_KEY in raw:  # not a transformers model (see skeleton.py)
        return build_module(p, raw[MODULE_KEY], dtype, trust_pickle=trust_pickle)
    return _build(_config(raw, p), dtype)


def _config(cfg: dict, p: Path):
    from transformers import CONFIG_MAPPING

    cfg.pop("quantization_config", None)
    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"{p}/config.json: unknown model_type {model_type!r}")
    return CONFIG_MAPPING[model_type].from_dict(cfg)


def _model_class(config):
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return model_class(config)


def _build(config, dtype: torch.dtype) -> nn.Module:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        no_init_weights = nullcontext
    cls = _model_class(config)
    with no_init_weights():  # every tensor is loaded afterwards; skip the random init
        if hasattr(cls, "_from_config"):
            return cls._from_config(config, dtype=dtype)
        return cls.from_config(config, dtype=dtype)


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise UsageError(f"unknown dtype {dtype!r}")
    return value


def check_checkpoint(path) -> dict:
    """Verify checkpoint folder ``path`` (``verify.verify_checkpoint``: every tensor its
    fp8ptq.json implies, with the right dtype and shape, finite positive scales, formats that
    parse, a config.json that agrees) from the safetensors headers and the scale values alone;
    returns its fp8ptq.json. ``DataError`` with the tensor and the rule otherwise."""
    p = Path(path).expanduser()
    meta = read_metadata(p)
    verify_checkpoint(p, meta, _read_config(p))
    return meta


def load_quantized(path, *, device="cpu", dtype=None, trust_pickle: bool = False):
    """Rebuild the quantized model stored in ``path``.

    ``dtype`` (default: the dtype it was saved in) is the dtype of the non-quantized tensors and
    of the dequantized GEMM weights. Returns ``fp8ptq.io.loading.LoadedModel`` (model in eval mode,
    tokenizer or None, kind "fp8ptq"); ``read_metadata(path)`` gives the fp8ptq.json contents.
    """
    p = Path(path).expanduser()
    meta = check_checkpoint(p)  # before anything is loaded or built
    layout = get_layout(meta["layout"])
    dtype = _as_dtype(dtype or meta.get("dtype") or "float32")
    tensors = _load_tensors(p)

    quant: dict[str, tuple] = {}
    for name, entry in meta["modules"].items():
        try:
            q = layout.read_gemm(tensors, name, entry)
        except KeyError as e:
            raise DataError(f"checkpoint {p} lacks tensor {e.args[0]}") from None
        quant[name] = (entry, q.codes, q.weight_scale, q.input_scale)

    experts = {name: (entry, _pop_experts(layout, tensors, name, entry, p))
               for name, entry in (meta.get("experts") or {}).items()}
    pop_kv_tensors(tensors, meta.get("taps"), p)
    model = _build_model(p, dtype, trust_pickle)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected:
        raise Fp8ptqError(f"checkpoint {p} has tensors the model lacks: {sorted(unexpected)[:5]}")
    _check_missing(model, missing, set(tensors),
                   {f"{n}.weight" for n in quant} | {f"{n}.{proj}" for n, (e, _) in experts.items()
                                                     for proj in e["projections"]})
    if hasattr(model, "tie_weights"):
        model.tie_weights()

    for name, (entry, codes, scale, input_scale) in quant.items():
        inner = model.get_submodule(name)
        _check_module(name, inner, entry, codes, scale)
        act_format = format_from_facts(entry.get("act_format"))
        q = QuantGemm(
            inner, weight_format=format_from_facts(entry["weight_format"]), weight_codes=codes,
            weight_scale=scale.float(),
            weight_granularity=weight_granularity(entry["weight_granularity"],
                                                  entry.get("block_size") or 128),
            act_format=act_format, input_scale=input_scale,
            act_granularity=entry.get("act_granularity") or "tensor",
            act_group_size=entry.get("act_group_size"))
        set_submodule(model, name, q)
    for name, (entry, projections) in experts.items():
        set_submodule(model, name, _quant_experts(model, name, entry, projections))
    install_taps(model, meta.get("taps"))  # after the QuantGemms: residual hooks find them

    model.to(device)
    model.eval()
    return _loaded(model, _tokenizer(p), p)


def _pop_experts(layout, tensors: dict, name: str, entry: dict, p: Path
                 ) -> dict[str, ProjectionQuant]:
    try:
        return layout.read_experts(tensors, name, entry)
    except KeyError as e:
        raise DataError(f"checkpoint {p} lacks tensor {e.args[0]}") from None


def _quant_experts(model, name: str, entry: dict, projections) -> QuantExperts:
    inner = model.get_submodule(name)
    info = experts_info(inner)
    if info is None or info.num_experts != entry["num_experts"] or \
            list(info.projections) != list(entry["projections"]):
        raise Fp8ptqError(f"{name}: the rebuilt model has no matching fused-experts module "
                          f"({entry['num_experts']} experts, {entry['projections']})")
    return QuantExperts(
        inner, info, weight_format=format_from_facts(entry["weight_format"]),
        weight_granularity=weight_granularity(entry["weight_granularity"],
                                              entry.get("block_size") or 128),
        act_format=format_from_facts(entry.get("act_format")),
        act_granularity=entry.get("act_granularity") or "tensor", projections=projections)


def _check_missing(model, missing, loaded: set[str], quantized: set[str]) -> None:
    """Allowed missing keys: the quantized GEMM weights (rebuilt from codes) and aliases of a
    loaded tensor (tied weights, e.g. lm_head.weight = embed_tokens.weight)."""
    names_of: dict[int, set[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)]:
        names_of.setdefault(id(t), set()).add(n)
    alias = {n: names for names in names_of.values() for n in names}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    bad = [k for k in missing if k not in quantized and k not in tied
           and not (alias.get(k, set()) - {k}) & (loaded | quantized)]
    if bad:
        raise Fp8ptqError(f"checkpoint lacks tensors the model needs: {sorted(bad)[:5]}")


def _check_module(name, inner, entry, codes, scale) -> None:
    if not hasattr(inner, "weight") or isinstance(inner, QuantGemm):
        raise Fp8ptqError(f"{name}: no GEMM module to quantize in the rebuilt model")
    k = gemm_kind(inner)
    if k != entry.get("kind", k):
        raise Fp8ptqError(f"{name}: checkpoint says {entry['kind']}, model has {k}")
    shape = tuple(weight_2d(inner).shape)
    if tuple(codes.shape) != shape:
        raise Fp8ptqError(f"{name}: codes {tuple(codes.shape)} do not match weight {shape}")
    if list(scale.shape) != list(entry.get("weight_scale_shape", scale.shape)):
        raise Fp8ptqError(f"{name}: weight_scale shape {list(scale.shape)} differs from "
                          f"fp8ptq.json {entry['weight_scale_shape']}")


def _tokenizer(p: Path):
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                          "vocab.txt", "vocab.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError, TypeError):
        return None
    if getattr(tok, "pad_token", None) is None and getattr(tok, "eos_token", None) is not None:
        tok.pad_token = tok.eos_token
    return tok


def _loaded(model, tokenizer, p: Path):
    return LoadedModel(model=model, tokenizer=tokenizer, source=str(p), kind="fp8ptq",
                       resolved_path=str(p.resolve()))
