"""FP8 attention in a compressed-tensors checkpoint as vLLM reads it (``fp8ptq validate``): the
config group on the attention classes, its query scales and how the runtime serves them.

What was read, and where:

* llm-compressor writes attention quantization as a config group targeting the attention class
  (``targets=["LlamaAttention"]``, no weights, ``input_activations`` 8-bit float, strategy
  ``tensor`` or ``attn_head``) and the same arguments as ``kv_cache_scheme``
  (vllm-project/llm-compressor examples/quantization_attention/README.md and
  llama3_attention.py; src/llmcompressor/modifiers/quantization/quantization/mixin.py
  ``_initialize_hooks``: q / k / v observers on the attention module);
* compressed-tensors shapes the scales (quantization/lifecycle/initialize.py
  ``initialize_attn_qparams``: ``q_scale`` from ``num_attention_heads``, ``k_scale`` /
  ``v_scale`` from ``num_key_value_heads``; ``[heads, 1, 1]`` under ``attn_head``, ``[1]`` per
  tensor) and finds attention modules by class name (``_is_attention_module``: "attention" in
  it);
* vLLM reads ``q_scale`` / ``k_scale`` / ``v_scale`` of an ``Attention`` layer only through the
  KV-cache method a ``kv_cache_scheme`` selects (vllm/model_executor/layers/quantization/
  compressed_tensors/compressed_tensors.py ``get_quant_method`` ->
  ``CompressedTensorsKVCacheMethod``; vllm/model_executor/layers/quantization/kv_cache.py
  ``BaseKVCacheMethod.create_weights`` / ``process_weights_after_loading``: a missing
  ``q_scale`` becomes ``k_scale``), serves a per-head query scale per KV head
  (vllm/model_executor/layers/attention/attention.py ``Attention.__init__``) and per-head scales
  on the Flash Attention backend only (docs/features/quantization/quantized_kvcache.md).
"""

from __future__ import annotations

from .verify import scale_problem

QUERY_STRATEGIES = {"tensor": "[1]", "attn_head": "[num_attention_heads, 1, 1]"}


def is_attention_group(scheme) -> bool:
    """A config group of attention quantization: no weights, input activations, and every
    target an attention class (compressed-tensors' ``_is_attention_module`` test on a name)."""
    return scheme.weights is None and scheme.input_activations is not None and \
        bool(scheme.targets) and all("attention" in t.lower() for t in scheme.targets)


def attention_violations(ck, config, violation) -> list:
    """The ``attention-group`` / ``attention-scales`` / ``attention-backend`` lines of a parsed
    ``QuantizationConfig``; ``violation(rule, module, message, fix, severity="error")`` builds
    one (``runtime_rules.Violation``)."""
    groups = {n: s for n, s in config.config_groups.items() if is_attention_group(s)}
    if not groups:
        return []
    out, kv = [], config.kv_cache_scheme
    fix = "re-quantize with --kv-cache fp8 --quantize-attention"
    for name, scheme in groups.items():
        a, where = scheme.input_activations, f"{name} ({', '.join(scheme.targets)})"
        if kv is None:
            out.append(violation("attention-group", where, "no kv_cache_scheme: vLLM reads "
                                 "q/k/v scales only through its KV-cache method", fix))
        elif a != kv:
            out.append(violation("attention-group", where, "input_activations differ from "
                                 "the kv_cache_scheme; vLLM quantizes Q, K and V with the "
                                 "kv_cache_scheme's arguments", fix))
        if (a.num_bits, a.type, bool(a.dynamic)) != (8, "float", False) or \
                a.strategy not in QUERY_STRATEGIES:
            out.append(violation("attention-group", where, f"{a.type}{a.num_bits} / "
                                 f"{a.strategy} / {'dynamic' if a.dynamic else 'static'}: vLLM "
                                 "serves static 8-bit float per tensor or per head only", fix))
    out += _query_scales(ck, kv, violation, fix)
    if kv is not None and kv.strategy == "attn_head":
        out.append(violation("attention-backend", "checkpoint", "per-head q/k/v scales are "
                             "served by vLLM's Flash Attention backend only (per KV head for "
                             "the query: each group's largest head scale)", "serve with "
                             "VLLM_ATTENTION_BACKEND=FLASH_ATTN", "note"))
    return out


def _query_scales(ck, kv, violation, fix) -> list:
    t, cfg = ck["tensors"], ck["config"]
    strategy = getattr(kv, "strategy", None)
    heads = cfg.get("num_attention_heads")
    shape = (1,) if strategy == "tensor" else (heads, 1, 1) if heads else None
    out = []
    for a in _attention_modules(ck):
        s = t.get(f"{a}.q_scale")
        if s is None:
            out.append(violation("attention-scales", a, f"{a}.q_scale is missing; vLLM would "
                                 "quantize the query with k_scale", fix))
        elif shape is not None and tuple(s.shape) != shape:
            out.append(violation("attention-scales", f"{a}.q_scale", f"shape "
                                 f"{tuple(s.shape)}, strategy {strategy} needs {shape}", fix))
        elif scale_problem(s):
            out.append(violation("attention-scales", f"{a}.q_scale", "a query scale is not "
                                 "finite and > 0", fix))
    return out


def _attention_modules(ck) -> list[str]:
    """Attention modules: parents of q_proj GEMMs and of written q/k/v scales."""
    names = {n.rpartition(".")[0] for n in (ck["meta"].get("modules") or {})
             if n.endswith(".q_proj")}
    names |= {k.rpartition(".")[0] for k in ck["tensors"]
              if k.endswith((".q_scale", ".k_scale", ".v_scale"))}
    return sorted(names)
