"""What vLLM and transformers accept, as data: each ``Rule`` cites the runtime source it was
read from and checks one thing against a checkpoint (``fp8ptq.json``, ``config.json``, the
tensors); a violation is one line with its fix. ``fp8ptq.checkpoint.validate`` runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..nn.fused import FUSED_SHARDS
from .attention_rules import attention_violations, is_attention_group
from .experts_io import SERVABLE
from .layouts import get_layout
from .reader import _load_tensors, _read_config, read_metadata
from .verify import SCALE_SUFFIXES, format_from_facts, scale_problem

TP_SIZES = (1, 2, 4, 8)
VLLM_CT = ("vLLM vllm/model_executor/layers/quantization/compressed_tensors/"
           "compressed_tensors.py")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value",
                   "fc1", "c_attn", "c_fc", "w1", "w3")



@dataclass
class Violation:
    rule: str
    module: str
    message: str
    fix: str
    severity: str = "error"  # "error" fails the runtime; "note" is information

    def line(self) -> str:
        return f"{self.module}: [{self.rule}] {self.message}; fix: {self.fix}"


@dataclass
class Rule:
    name: str
    runtime: str
    source: str
    check: Callable[[dict], list[Violation]]


# --- the checkpoint as the rules see it ---------------------------------------------------------


def read_checkpoint(path) -> dict:
    p = Path(path).expanduser()
    meta = read_metadata(p)
    return {"path": p, "meta": meta, "config": _read_config(p), "tensors": _load_tensors(p)}


def _modules(ck) -> dict:
    return ck["meta"].get("modules") or {}


def _fmt(entry, key) -> str | None:
    facts = entry.get(key)
    return None if facts is None else facts.get("name")


def _ct_type(entry, key) -> str | None:
    """The compressed-tensors type ("float" / "int") of an fp8ptq.json format entry."""
    spec = format_from_facts(entry.get(key))
    return None if spec is None else spec.compressed_tensors_type


def served(ck, runtime: str) -> bool:
    """Does ``runtime`` load this checkpoint's layout natively?"""
    return runtime in get_layout(ck["meta"]["layout"]).runtimes


# --- vLLM rules ---------------------------------------------------------------------------------


def _layout(ck) -> list[Violation]:
    if served(ck, "vllm"):
        return []
    return [Violation("layout", "checkpoint", "the fp8ptq-native layout ("
                      f"{ck['meta'].get('layout_reason', '')}) is read by fp8ptq.load only",
                      "use e4m3 or int8 on nn.Linear modules (compressed-tensors output)")]


def _scheme(ck) -> list[Violation]:
    """vLLM's ``_get_scheme_from_parts``: fp8 W8A8 needs static symmetric tensor / channel /
    block weights and dynamic inputs or static symmetric per-tensor inputs; int8 W8A8 needs
    tensor or channel weights; otherwise "No compressed-tensors compatible scheme was found"."""
    out = []
    for name, e in _modules(ck).items():
        a = _fmt(e, "act_format")
        wg, ag = e.get("weight_granularity"), e.get("act_granularity")
        if _ct_type(e, "weight_format") == "int" and wg == "block":
            out.append(Violation("scheme", name, "int8 with block weight scales has no vLLM "
                                 "scheme", "--weight-granularity channel"))
        if a is not None and ag == "tensor" and e.get("input_scale") is None:
            out.append(Violation("static-input", name, "static activations without an "
                                 "input_scale", "re-quantize with calibration data"))
    return out


# The 8-bit part of vLLM's ``CompressedTensorsConfig._get_scheme_from_parts``, as a table:
# (weight type, weight strategies, input type, input strategy, input dynamic) -> vLLM scheme.
# ``None`` input strategy/dynamic = weight-only. Weights must be 8-bit, symmetric and static in
# every row (``_is_fp8_w8a8``, ``_is_static_tensor_w8a8``, ``_is_dynamic_token_w8a8``,
# ``_is_fp8_w8a16``, ``_is_wNa16_group_channel``); static inputs must also be symmetric for FP8.
VLLM_LINEAR_SCHEMES = (
    ("float", ("tensor", "channel", "block"), "float", None, True, "CompressedTensorsW8A8Fp8"),
    ("float", ("tensor", "channel", "block"), "float", "tensor", False,
     "CompressedTensorsW8A8Fp8"),
    ("float", ("tensor", "channel", "block"), None, None, None, "CompressedTensorsW8A16Fp8"),
    ("int", ("tensor", "channel"), "int", "tensor", False, "CompressedTensorsW8A8Int8"),
    ("int", ("tensor", "channel"), "int", "token", True, "CompressedTensorsW8A8Int8"),
    ("int", ("channel", "group"), None, None, None, "CompressedTensorsWNA16"),
)
ACT_QUANT_FORMATS = ("naive-quantized", "int-quantized", "float-quantized")
MXFP8_SCHEME = "CompressedTensorsW8A8Mxfp8"


def vllm_linear_scheme(w, a) -> str | None:
    """The vLLM scheme a (weights, input_activations) pair of ``QuantizationArgs`` selects, or
    ``None`` where vLLM raises "No compressed-tensors compatible scheme was found"."""
    if w is None or w.num_bits != 8 or not w.symmetric or w.dynamic:
        return None
    if w.type == "float" and w.strategy == "group" and w.group_size == 32 and \
            w.scale_dtype == torch.uint8:  # _is_mxfp8: E8M0 scales, inputs as the kernel wants
        return MXFP8_SCHEME
    if a is not None and (a.num_bits != 8 or a.type == "float" and not a.dynamic
                          and not a.symmetric):
        return None
    for wt, ws, at, ast, adyn, scheme in VLLM_LINEAR_SCHEMES:
        if w.type != wt or w.strategy not in ws:
            continue
        if a is None and at is None:
            return scheme
        if a is not None and at == a.type and bool(a.dynamic) == adyn and (
                ast is None or a.strategy == ast):
            return scheme
    return None


def parse_ct_config(qc: dict):
    """``quantization_config`` parsed by compressed-tensors' own ``QuantizationConfig``, as
    vLLM and transformers both parse it: ``(config, None)``, or ``(None, violation)`` carrying
    the parse error, since a config neither runtime can parse cannot be served by either."""
    from compressed_tensors.quantization import QuantizationConfig

    try:
        return QuantizationConfig.model_validate(qc), None
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError and friends
        return None, Violation("ct-config", "config.json", "quantization_config does not "
                               f"validate ({_parse_error(e)})", "re-write with fp8ptq quantize")


def _parse_error(e: Exception) -> str:
    """The first error of a pydantic ``ValidationError`` as ``where: message`` (its ``str``
    runs over many lines and names only the model first); other exceptions' first line."""
    errors = getattr(e, "errors", None)
    if callable(errors) and errors():
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if "[" not in str(p))
        return f"{where}: {first.get('msg', '')}" if where else first.get("msg", "")
    return (str(e).splitlines() or [type(e).__name__])[0]


def _config_groups(ck) -> list[Violation]:
    """What vLLM reads is ``config.json``, not fp8ptq.json: every config group's arguments,
    parsed by compressed-tensors' own classes, must select a vLLM scheme."""
    qc = ck["config"].get("quantization_config")
    if not served(ck, "vllm") or not qc:
        return []
    config, refused = parse_ct_config(qc)
    if config is None:
        return [refused]
    out = []
    for group, scheme in config.config_groups.items():
        if is_attention_group(scheme):  # read by the KV-cache method, not as a Linear scheme
            continue
        where = f"{group} ({', '.join(scheme.targets)})"
        a = scheme.input_activations
        chosen = vllm_linear_scheme(scheme.weights, a)
        if chosen is None:
            w = scheme.weights
            out.append(Violation("ct-scheme", where, "no vLLM scheme for weights "
                                 f"{_args(w)} with inputs {_args(a)}: static activations must "
                                 "be per-tensor and symmetric, weights static and symmetric",
                                 "--act-granularity tensor or token (default e4m3 recipe)"))
        fmt = scheme.format or config.format
        # MXFP8 is selected from the weights alone (``_is_mxfp8``) with its own compressor
        # format, ``mxfp8-quantized``; every other activation scheme needs an activation format
        if a is not None and fmt not in ACT_QUANT_FORMATS and chosen != MXFP8_SCHEME:
            out.append(Violation("ct-format", where, f"format {fmt!r} is not an activation-"
                                 "quantization format; vLLM would ignore the input scheme",
                                 "re-write with fp8ptq quantize"))
    return out


def _args(q) -> str:
    if q is None:
        return "none"
    return (f"{q.type}{q.num_bits}/{q.strategy}/{'dynamic' if q.dynamic else 'static'}/"
            f"{'symmetric' if q.symmetric else 'asymmetric'}")


def _block(ck) -> list[Violation]:
    """Block-FP8 weights: vLLM quantizes the activations per 1x128 group on the fly (a static
    input scale is not used), and every weight dimension it shards must split into whole
    blocks: the output dimension of column-parallel layers and the input dimension of
    row-parallel ones, under each tensor-parallel size."""
    out = []
    for name, e in _modules(ck).items():
        if e.get("weight_granularity") != "block":
            continue
        block = e.get("block_size") or 128
        rows, cols = e["weight_codes_shape"]
        if e.get("act_format") and e.get("act_granularity") == "tensor":
            out.append(Violation("block-activations", name, "block weights with static "
                                 "activations: vLLM's block-FP8 path quantizes activations "
                                 "dynamically per group", "--act-granularity token (or group)"))
        sharded = rows if name.rsplit(".", 1)[-1] in COLUMN_PARALLEL else cols
        ok = [tp for tp in TP_SIZES if sharded % tp == 0 and (sharded // tp) % block == 0]
        if 1 not in ok:
            out.append(Violation("block-shape", name, f"dimension {sharded} is not a multiple "
                                 f"of the block size {block}", f"--block-size dividing {sharded}"))
        elif max(ok) < max(TP_SIZES):
            out.append(Violation("block-tp", name, f"splits into whole {block}-blocks only "
                                 f"up to tensor parallelism {max(ok)}",
                                 "serve with --tensor-parallel-size <= " + str(max(ok)), "note"))
    return out


def _fused(ck) -> list[Violation]:
    """vLLM fuses q/k/v and gate/up into one GEMM and uses the largest input scale (and, for
    per-tensor weights, requantizes to the largest weight scale): shards whose scales differ are
    served with numbers fp8ptq did not evaluate."""
    t, out = ck["tensors"], []
    names = list(_modules(ck))
    present = set(names)
    for parent in sorted({n.rpartition(".")[0] for n in names}):
        for shards in FUSED_SHARDS:
            group = [f"{parent}.{s}" for s in shards]
            if not all(g in present for g in group):
                continue
            for leaf in ("input_scale", "weight_scale"):
                tensors = [t.get(f"{g}.{leaf}") for g in group]
                if any(x is None for x in tensors) or leaf == "weight_scale" and \
                        tensors[0].numel() != 1:
                    continue
                if len({float(x.reshape(-1)[0]) for x in tensors}) > 1:
                    out.append(Violation("fused-scales", parent, f"{'/'.join(shards)} have "
                                         f"different {leaf}s; vLLM serves the fused GEMM with "
                                         "the largest", "--unify-fused-scales"))
    return out


def _moe(ck) -> list[Violation]:
    """vLLM's fused-MoE FP8 (CompressedTensorsW8A8Fp8MoEMethod) takes per-tensor weights with
    static per-tensor activations or per-channel weights with dynamic per-token activations."""
    out = []
    for name, e in (ck["meta"].get("experts") or {}).items():
        combo = (e.get("weight_granularity"), e.get("act_granularity"))
        if _fmt(e, "weight_format") != "e4m3" or combo not in SERVABLE:
            out.append(Violation("fused-moe", name, f"{combo[0]} weights with {combo[1]} "
                                 "activations have no vLLM fused-MoE FP8 kernel",
                                 "--weight-granularity tensor, or --act-granularity token"))
        elif not e.get("checkpoint_keys"):
            out.append(Violation("fused-moe-names", name, "experts stored as fp8ptq stacks",
                                 "re-write as compressed-tensors"))
    return out


def _kv(ck) -> list[Violation]:
    """KV-cache scales: vLLM reads ``<attention>.k_scale`` / ``.v_scale`` when the config has a
    ``kv_cache_scheme`` (one value per tensor, or per KV head with strategy ``attn_head``:
    compressed-tensors shapes it ``[num_key_value_heads, 1, 1]``); a missing one is silently
    replaced by 1.0, a NaN or non-positive one turns attention into NaN."""
    qc = ck["config"].get("quantization_config") or {}
    scheme = qc.get("kv_cache_scheme")
    if not scheme:
        return []
    t, out = ck["tensors"], []
    shape = _kv_shape(ck["config"], scheme.get("strategy"))
    attn = sorted({n.rpartition(".")[0] for n in _modules(ck) if n.endswith(".q_proj")})
    for a in attn:
        for k in ("k_scale", "v_scale"):
            name, s = f"{a}.{k}", t.get(f"{a}.{k}")
            if s is None:
                out.append(Violation("kv-scales", a, f"kv_cache_scheme is set but {name} is "
                                     "missing; vLLM would use 1.0", "re-quantize with --kv-cache"))
            elif shape is not None and tuple(s.shape) != shape:
                out.append(Violation("kv-scales", name, f"shape {tuple(s.shape)}, strategy "
                                     f"{scheme.get('strategy')} needs {shape}",
                                     "re-quantize with --kv-cache"))
            elif scale_problem(s):
                out.append(Violation("kv-scales", name, "a KV scale is not finite and > 0",
                                     "re-quantize with --kv-cache"))
    return out


def _kv_shape(config: dict, strategy) -> tuple[int, ...] | None:
    """The k/v scale shape compressed-tensors' ``initialize_qparams`` gives ``strategy``."""
    if strategy == "tensor":
        return (1,)
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    return (heads, 1, 1) if strategy == "attn_head" and heads else None


def _attention(ck) -> list[Violation]:
    """FP8 attention: the attention config group and its query scales (``attention_rules``)."""
    qc = ck["config"].get("quantization_config")
    if not served(ck, "vllm") or not qc:
        return []
    config, refused = parse_ct_config(qc)
    return [] if config is None else attention_violations(ck, config, Violation)


def _scales(ck) -> list[Violation]:
    return [Violation("finite-scales", k, "a scale is NaN, inf, zero or negative",
                      "re-quantize (fp8ptq never writes one)")
            for k, v in ck["tensors"].items() if k.endswith(SCALE_SUFFIXES)
            and scale_problem(v)]


def _fnuz_note(ck) -> list[Violation]:
    if not served(ck, "vllm"):
        return []
    return [Violation("fnuz", "checkpoint", "on FNUZ hardware (MI300) vLLM loads OCP e4m3 codes "
                      "as e4m3fnuz and doubles every scale (0x80 becomes 0)", "nothing to do",
                      "note")]


# --- transformers rules -------------------------------------------------------------------------


def _ct_config(ck) -> list[Violation]:
    if not served(ck, "transformers"):
        return [Violation("layout", "checkpoint", "transformers does not know the fp8ptq-native "
                          "layout (it would load the model without its quantized weights)",
                          "load it with fp8ptq.load")]
    _, refused = parse_ct_config(ck["config"].get("quantization_config") or {})
    return [] if refused is None else [refused]


RULES = [
    Rule("layout", "vllm", f"{VLLM_CT}: CompressedTensorsConfig (quant_method)", _layout),
    Rule("scheme", "vllm", f"{VLLM_CT}: _get_scheme_from_parts, _is_fp8_w8a8, "
         "_is_static_tensor_w8a8, _is_dynamic_token_w8a8", _scheme),
    Rule("ct-scheme", "vllm", f"{VLLM_CT}: _get_scheme_from_parts, _is_fp8_w8a8, "
         "_is_mxfp8, _is_fp8_w8a16, _is_static_tensor_w8a8, _is_dynamic_token_w8a8, "
         "_is_wNa16_group_channel; is_activation_quantization_format", _config_groups),
    Rule("block", "vllm", "vLLM compressed_tensors_w8a8_fp8.py / fp8_utils.py: block-FP8 "
         "(per-group dynamic activations, validate_fp8_block_shape)", _block),
    Rule("fused-scales", "vllm", "vLLM linear.py QKVParallelLinear / MergedColumnParallelLinear "
         "weight loaders (max of the shards' scales)", _fused),
    Rule("fused-moe", "vllm", "vLLM compressed_tensors_moe.py: CompressedTensorsW8A8Fp8MoEMethod "
         "(per-tensor/static, per-channel/dynamic; one input scale per layer)", _moe),
    Rule("kv-scales", "vllm", f"{VLLM_CT}: get_cache_scale, kv_cache_scheme", _kv),
    Rule("attention", "vllm", "vLLM kv_cache.py BaseKVCacheMethod, attention.py Attention "
         "(query_quant); llm-compressor examples/quantization_attention; compressed-tensors "
         "initialize_attn_qparams", _attention),
    Rule("finite-scales", "vllm", "every runtime: a NaN scale turns a layer's output to NaN",
         _scales),
    Rule("fnuz", "vllm", "vLLM fp8_utils.py normalize_e4m3fn_to_e4m3fnuz", _fnuz_note),
    Rule("ct-config", "transformers", "compressed-tensors QuantizationConfig (pydantic)",
         _ct_config),
]
