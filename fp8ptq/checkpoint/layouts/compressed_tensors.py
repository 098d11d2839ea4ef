"""The ``compressed-tensors`` layout: what llm-compressor writes and transformers
(``CompressedTensorsHfQuantizer``) and vLLM read.

Chosen when every quantized GEMM is an ``nn.Linear`` with one 8-bit type throughout (OCP E4M3
or int8; activations the same type or unquantized): compressed-tensors quantizes only Linear
(and Embedding) modules, so transformers' ``Conv1D`` (GPT-2) would load unquantized, i.e.
silently wrong, through transformers' default path. Fused experts go in too when vLLM's
fused-MoE kernels serve their recipe and transformers' conversion mapping names them
(``experts_io``).

Tensors: ``NAME.weight`` (``float8_e4m3fn`` / ``int8`` ``[out, in]``, the code bytes
reinterpreted), ``NAME.weight_scale``, ``NAME.input_scale`` (static activations). The
``quantization_config`` is built from compressed-tensors' own pydantic classes
(``QuantizationArgs`` / ``QuantizationScheme`` / ``QuantizationConfig``) and dumped, so what we
write is what compressed-tensors validates; ``weight_args`` / ``input_args`` give the arguments of
one module: FP8_BLOCK (block weights, dynamic 1x128 group activations) and MXFP8 (32-value
groups with E8M0 ``uint8`` scales, the ``mxfp8-quantized`` compressor) included.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ...errors import DataError, Fp8ptqError, first_line
from ...formats import get_format
from ...nn.quant_experts import ProjectionQuant
from ...taps.tap_report import query_modules_from_report
from ...taps.taps import KV_OBSERVER, kv_granularity_from_report
from ..expect import SCALE_DTYPES, Expect, dtype_name
from ..experts_io import checkpoint_keys, ct_problem, ct_tensors, pop_ct_tensors, router_modules
from ..names import CT_FLOAT, CT_INT, CT_MIXED, CT_MXFP8, CT_NAIVE, LAYOUT_CT, META_NAME, ct_type
from .base import (
    GemmQuant,
    Layout,
    ModuleDesc,
    input_scale_tensor,
    read_weight_scale,
    weight_scale_tensor,
)
from .native import gemm_scales

CT_CODES = {"float": torch.float8_e4m3fn, "int": torch.int8}  # compressed-tensors type -> dtype


def weight_args(desc: ModuleDesc) -> dict:
    """``QuantizationArgs`` fields of a module's weights. Block weights (FP8_BLOCK):
    ``strategy: block, block_structure: [B, B]``; MX formats (compressed-tensors' ``MXFP8``):
    ``strategy: group, group_size: 32, scale_dtype: uint8`` (E8M0 scales)."""
    args = {"num_bits": 8, "type": ct_type(desc.weight_format), "symmetric": True,
            "group_size": None, "strategy": desc.weight_granularity, "dynamic": False}
    if desc.weight_granularity == "block":
        args["block_structure"] = [desc.block_size, desc.block_size]
    if desc.weight_granularity == "group":
        args["group_size"] = desc.block_size
    if desc.weight_format.mx_block is not None:
        args["scale_dtype"] = "uint8"
    return args


def input_args(desc: ModuleDesc) -> dict | None:
    """``QuantizationArgs`` fields of a module's input activations (None: weight-only):
    static ``tensor``, dynamic ``token``, or dynamic ``group`` with its ``group_size``
    (FP8_BLOCK's 1x128; MX: 32 with ``scale_dtype: uint8``)."""
    if desc.act_format is None:
        return None
    dynamic = desc.act_granularity != "tensor"
    args = {"num_bits": 8, "type": ct_type(desc.act_format), "symmetric": True,
            "group_size": desc.act_group_size if desc.act_granularity == "group" else None,
            "strategy": desc.act_granularity, "dynamic": dynamic}
    if desc.act_format.mx_block is not None:
        args["scale_dtype"] = "uint8"
    return args


def group_format(w: dict, a: dict | None) -> str:
    """compressed-tensors' ``format`` of a config group (its compressor)."""
    if w.get("scale_dtype") == "uint8":
        return CT_MXFP8
    return CT_NAIVE if a is None else (CT_FLOAT if w["type"] == "float" else CT_INT)


def kv_cache_scheme(granularity: str) -> dict:
    """compressed-tensors ``QuantizationArgs`` of an FP8 KV cache, as vLLM's
    ``CompressedTensorsKVCacheMethod`` validates it (8-bit float, symmetric, strategy
    ``tensor`` or ``attn_head``); static min-max scales from the calibration pass."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
            "strategy": "attn_head" if granularity == "head" else "tensor", "dynamic": False,
            "observer": KV_OBSERVER}


ATTENTION_GROUP = "attention"  # llm-compressor's examples name the group so


def attention_group(targets, kv_scheme: dict):
    """The config group of FP8 attention as llm-compressor 0.14 writes it
    (vllm-project/llm-compressor examples/quantization_attention/llama3_attention.py:
    ``QuantizationScheme(targets=["LlamaAttention"], input_activations=QuantizationArgs(
    num_bits=8, type="float", strategy="tensor" | "attn_head"))``): the attention classes as
    targets, no weights, the KV cache's arguments as ``input_activations`` (compressed-tensors
    quantization/lifecycle/initialize.py ``initialize_attn_qparams`` gives ``q_scale``,
    ``k_scale`` and ``v_scale`` from them, ``_validate_attention_scheme`` refuses weights and
    output activations) and ``format: dense`` (what compressed-tensors'
    ``infer_module_format`` gives a module without weights)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=list(targets), input_activations=QuantizationArgs(
        **kv_scheme), format="dense")


def _cached_attention(module: nn.Module) -> bool:
    """Would compressed-tensors' ``kv_cache_scheme`` give this module k_scale / v_scale?"""
    try:
        from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module
    except ImportError:  # older compressed-tensors: no KV-cache scales written
        return False
    return bool(is_cached_attention_module(module))


class CompressedTensorsLayout(Layout):
    name = LAYOUT_CT
    library_name = "transformers"
    card_tags = ("compressed-tensors",)
    runtimes = ("transformers", "vllm")

    # -- choosing -----------------------------------------------------------------------------

    def accepts(self, modules, *, model_type=None):
        gemms = [m for m in modules if not m.is_experts]
        for m in gemms:
            problem = self.module_problem(m, model_type=model_type)
            if problem:
                return problem
        if not gemms:
            return "no nn.Linear module is quantized"
        if len({ct_type(m.weight_format) for m in gemms}) != 1:
            return "float and int modules mixed"
        experts = [m for m in modules if m.is_experts]
        for m in experts:
            problem = self.module_problem(m, model_type=model_type)
            if problem:
                return problem
        if experts and len({(m.weight_granularity, m.act_granularity) for m in modules}) != 1:
            return "experts and Linear modules use different schemes"
        return None

    def module_problem(self, m, *, model_type=None):
        if m.is_experts:
            if ct_problem(m):
                return ct_problem(m)
            if checkpoint_keys(model_type, m) is None:
                return (f"{m.name}: transformers has no per-expert checkpoint names for this "
                        "architecture")
            return None
        wt = ct_type(m.weight_format)
        at = ct_type(m.act_format) if m.act_format is not None else wt
        if wt is None or at != wt:
            act = m.act_format.name if m.act_format is not None else "none"
            return (f"{m.name}: weight {m.weight_format.name} / activation {act} "
                    "has no compressed-tensors equivalent")
        if m.kind != "linear":
            return f"{m.name}: a {m.kind} module; compressed-tensors quantizes nn.Linear only"
        return None

    def why(self, modules, *, model_type=None) -> str:
        experts = [m for m in modules if m.is_experts]
        if experts:
            return (f"nn.Linear and {len(experts)} fused-experts modules with e4m3 weights, "
                    "experts under transformers' per-expert checkpoint names")
        first = next(m for m in modules if not m.is_experts)
        return (f"all quantized modules are nn.Linear with {ct_type(first.weight_format)} "
                "8-bit weights")

    def refusal_warning(self, modules, reason, chosen):
        gemms = [m for m in modules if not m.is_experts]
        if len(gemms) == len(modules) or self.accepts(gemms) is not None:
            return None  # refused for the GEMMs themselves: the expected fallback
        return f"written in the {chosen} layout, not {self.name} (vLLM would not serve it): " \
               f"{reason}"

    # -- writing ------------------------------------------------------------------------------

    def gemm_tensors(self, desc: ModuleDesc, q: GemmQuant) -> dict[str, torch.Tensor]:
        dt = CT_CODES[ct_type(desc.weight_format)]
        t = {f"{desc.name}.weight": q.codes.detach().view(dt),
             f"{desc.name}.weight_scale": weight_scale_tensor(desc, q)}
        if q.input_scale is not None:
            t[f"{desc.name}.input_scale"] = input_scale_tensor(q)
        return t

    def gemm_stored_as(self, desc: ModuleDesc) -> dict:
        return {"weight": f"{desc.weight_format.torch_dtype or 'int8'} [out, in]"}

    def experts_tensors(self, desc, projections, *, model_type=None):
        return ct_tensors(desc, projections, checkpoint_keys(model_type, desc))

    def experts_facts(self, desc, *, model_type=None) -> dict:
        return {"checkpoint_keys": checkpoint_keys(model_type, desc)}

    def kv_cache(self, model, report, tensors):
        granularity = kv_granularity_from_report(report)
        if granularity is not None:  # --kv-cache: written as vLLM reads it, whatever
            # compressed-tensors' own KV-cached-attention detection says on this stack
            head = granularity == "head"
            note = ("kv_cache_scheme + tensors <attention>.k_scale / .v_scale "
                    f"({'[num_key_value_heads, 1, 1]' if head else '[1]'})")
            if query_modules_from_report(report):
                q_shape = "[num_attention_heads, 1, 1]" if head else "[1]"
                note += (", FP8 attention: a config group on the attention classes + "
                         f"<attention>.q_scale ({q_shape})")
            return tensors, kv_cache_scheme(granularity), note
        fmt = get_format(next(iter(report.values()))["format"])
        kv_type = ct_type(fmt)
        if kv_type is None:
            return {}, None, f"not written: compressed-tensors has no KV-cache type for {fmt.name}"
        attention = dict.fromkeys(k.rpartition(".")[0] for k in tensors)
        odd = [a for a in attention if not _cached_attention(model.get_submodule(a))]
        if odd:
            return {}, None, (f"not written: compressed-tensors does not treat {odd[0]} as a "
                              "KV-cached attention module (all taps: fp8ptq.json)")
        scheme = {"num_bits": 8, "type": kv_type, "symmetric": True, "group_size": None,
                  "strategy": "tensor", "dynamic": False}
        return tensors, scheme, "kv_cache_scheme + tensors <attention>.k_scale / .v_scale"

    def quantization_config(self, model, modules, *, kv_scheme=None, attention_targets=(),
                            tool_version=""):
        """One config group per distinct scheme; a single group targets the class ``Linear``
        and ignores the Linear modules left unquantized (lm_head, routers...), several groups
        name their modules exactly. FP8 attention adds the group ``attention`` (see
        ``attention_group``)."""
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationConfig,
            QuantizationScheme,
        )

        gemms = [m for m in modules if not m.is_experts]
        groups: dict[str, dict] = {}
        members: dict[str, list[str]] = {}
        for m in gemms:
            w, a = weight_args(m), input_args(m)
            key = json.dumps([w, a], sort_keys=True)
            if key not in groups:
                groups[key] = {"weights": w, "input_activations": a, "format": group_format(w, a)}
                members[key] = []
            members[key].append(m.name)
        qnames = {m.name for m in gemms}
        ignore = [n for n, mod in model.named_modules()
                  if isinstance(mod, nn.Linear) and n not in qnames
                  and not (n.endswith(".inner") and n.removesuffix(".inner") in qnames)]
        ignore += router_modules(model, [m.name for m in modules if m.is_experts])
        single = len(groups) == 1
        schemes = {
            f"group_{i}": QuantizationScheme(
                targets=["Linear"] if single else list(members[key]),
                weights=QuantizationArgs(**g["weights"]),
                input_activations=None if g["input_activations"] is None else
                QuantizationArgs(**g["input_activations"]))
            for i, (key, g) in enumerate(groups.items())}
        if attention_targets:
            schemes[ATTENTION_GROUP] = attention_group(attention_targets, kv_scheme)
        formats = {g["format"] for g in groups.values()}
        config = QuantizationConfig(
            config_groups=schemes, quant_method="compressed-tensors",
            kv_cache_scheme=None if kv_scheme is None else QuantizationArgs(**kv_scheme),
            format=formats.pop() if len(formats) == 1 else CT_MIXED,
            quantization_status="compressed", ignore=ignore)
        out = config.model_dump(mode="json")
        for i, g in enumerate(groups.values()):  # per-group format, as compressed-tensors does
            out["config_groups"][f"group_{i}"]["format"] = g["format"]
        return out

    # -- reading ------------------------------------------------------------------------------

    def read_gemm(self, tensors, name, entry) -> GemmQuant:
        w = tensors.pop(f"{name}.weight")
        facts = entry["weight_format"]
        want = torch.float8_e4m3fn if facts.get("bits") == 8 and facts.get("exponent_bits") \
            else torch.int8
        if w.dtype != want:
            raise Fp8ptqError(f"{name}.weight is {w.dtype}, expected {want}")
        scale = read_weight_scale(tensors.pop(f"{name}.weight_scale"))
        return GemmQuant(w.view(torch.uint8), scale, tensors.pop(f"{name}.input_scale", None))

    def read_experts(self, tensors, name, entry) -> dict[str, ProjectionQuant]:
        return {proj: ProjectionQuant(codes, scale.float(), inp) for proj, (codes, scale, inp)
                in pop_ct_tensors(tensors, entry).items()}

    # -- verifying ----------------------------------------------------------------------------

    def expect_gemm(self, name: str, entry: dict) -> Iterable[Expect]:
        yield Expect(f"{name}.weight", "codes", tuple(CT_CODES.values()),
                     entry.get("weight_codes_shape"), source=f"fp8ptq.json module {name}")
        yield from gemm_scales(name, entry)

    def expect_experts(self, name: str, entry: dict) -> Iterable[Expect]:
        src = f"fp8ptq.json experts {name}"
        static = entry.get("act_format") and entry.get("act_granularity") == "tensor"
        for shards in (entry.get("checkpoint_keys") or {}).values():
            for e in range(entry["num_experts"]):
                for key, _lo, _hi in shards:
                    k = key.format(e=e)
                    stem = k.removesuffix("weight")
                    yield Expect(k, "codes", (torch.float8_e4m3fn,), source=src)
                    yield Expect(stem + "weight_scale", "scale", SCALE_DTYPES, source=src)
                    yield Expect(stem + "input_scale", "scale", SCALE_DTYPES,
                                 required=bool(static), source=src)

    def check_config(self, folder, meta, config, index) -> None:
        """config.json's ``quantization_config`` (compressed-tensors' own pydantic classes
        validate it) must quantize every module fp8ptq.json lists, with the codes type, weight
        strategy and activation scheme its tensors have."""
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        where = f"{Path(folder)}/config.json"
        qc = config.get("quantization_config")
        if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors" or \
                not qc.get("config_groups"):
            raise DataError(f"{where} has no compressed-tensors quantization_config, but "
                            f"{META_NAME} says the layout is compressed-tensors")
        try:
            parsed = QuantizationConfig.model_validate(qc)
        except ValidationError as e:
            first = e.errors()[0]
            at = ".".join(str(x) for x in first.get("loc", ()) if "[" not in str(x))
            raise DataError(f"{where}: quantization_config does not validate ({at}: "
                            f"{first.get('msg')})") from None
        except (ValueError, TypeError) as e:
            raise DataError(f"{where}: quantization_config does not validate "
                            f"({first_line(e)})") from None
        ignore = set(parsed.ignore or [])
        for name, entry in (meta.get("modules") or {}).items():
            group = _group_of(name, entry, parsed.config_groups)
            if group is None or name in ignore:
                raise DataError(f"{where}: no quantization_config group quantizes {name}, but "
                                "its tensors are quantized")
            gname, scheme = group
            weights, acts = scheme.weights, scheme.input_activations
            codes = f"{name}.weight"
            want = None if weights is None else \
                CT_CODES.get(str(getattr(weights.type, "value", weights.type)))
            if want is None or index.dtype(codes) != want:
                raise DataError(f"{where}: {gname} says {getattr(weights, 'type', None)} "
                                f"weights, but tensor {codes} is {dtype_name(index.dtype(codes))}")
            strategy = str(getattr(weights.strategy, "value", weights.strategy))
            if strategy != entry.get("weight_granularity"):
                raise DataError(f"{where}: {gname} says {strategy} weight scales, but "
                                f"{META_NAME} says {entry.get('weight_granularity')} for {name}")
            static = acts is not None and not acts.dynamic
            if static and f"{name}.input_scale" not in index:
                raise DataError(f"{where}: {gname} says static activations, but tensor "
                                f"{name}.input_scale is missing")
            if acts is None and entry.get("act_format"):
                raise DataError(f"{where}: {gname} has no input_activations, but {META_NAME} "
                                f"says {name} quantizes its activations")


def _group_of(name: str, entry: dict, groups: dict):
    for gname, scheme in groups.items():
        for target in scheme.targets:
            if target == name or target == entry.get("class") or \
                    (target.startswith("re:") and re.fullmatch(target[3:], name)):
                return gname, scheme
    return None
