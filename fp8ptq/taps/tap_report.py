"""The activation taps' ``freeze`` report read back: the scales a checkpoint writes per attention
module, and the runtime's view of a per-head query scale.

Tap kinds (``report[tap]["kind"]``):

* ``"attention"``: ``--quantize-attention`` alone, the simulation of Micikevicius et al.,
  "FP8 Formats for Deep Learning", 2022 (sec 4.2-4.3): Q, K, V and P per tensor in the
  activation format; no runtime reads these scales.
* ``"kv"``: ``--kv-cache fp8``, K (after RoPE) and V in e4m3 per tensor or per KV head, the
  scales vLLM reads as ``<attention>.k_scale`` / ``.v_scale``.
* ``"query"``: ``--kv-cache fp8 --quantize-attention``, FP8 attention as llm-compressor writes
  it: the query (after RoPE) calibrated beside K / V in the same pass, with the same
  arguments (vllm-project/llm-compressor examples/quantization_attention/README.md: "attention
  quantization also implicitly applies kv cache quantization with the same quantization
  arguments"), written as ``<attention>.q_scale``.
"""

from __future__ import annotations

import torch

from .tap_sites import ATTENTION_ROLES

KV_ROLES = ("k", "v")  # the KV cache's taps (``--kv-cache``): the tensors the runtime caches
KV_OBSERVER = "minmax"  # compressed-tensors' name for the KV scales' observer: amax / max
CACHE_KINDS = ("kv", "query")  # taps whose scales a runtime reads (min-max, e4m3, tensor / head)


def number(x):
    """A scalar or per-head value as fp8ptq.json holds it: a float, or a list of floats."""
    x = torch.as_tensor(x, dtype=torch.float32)
    return float(x) if x.dim() == 0 else x.tolist()


def attention_scales_from_report(report: dict) -> dict[str, dict[str, float]]:
    """Per attention module ``{"q_scale", "k_scale", "v_scale", "p_scale"}`` from a ``freeze``
    report (e.g. ``QuantizeResult.extras["taps"]``, where the taps object itself is not kept)."""
    out: dict[str, dict[str, float]] = {}
    for tap, entry in report.items():
        module, _, role = tap.rpartition(":")
        if entry.get("kind") == "attention" and role in ATTENTION_ROLES:
            out.setdefault(module, {})[f"{role}_scale"] = float(entry["scale"])
    return out


def kv_scales_from_report(report: dict) -> dict[str, dict[str, float | list[float]]]:
    """``{attention module: {"k_scale", "v_scale"[, "q_scale"]}}`` from a ``freeze`` report, the
    scale tensors a checkpoint holds per attention module: the simulation's K / V scales, or the
    KV-cache taps' (a list of one per KV head with ``head``), plus the query's under FP8
    attention (one per query head with ``head``)."""
    out = {a: {"k_scale": s["k_scale"], "v_scale": s["v_scale"]}
           for a, s in attention_scales_from_report(report).items()}
    for tap, entry in report.items():
        module, _, role = tap.rpartition(":")
        if entry.get("kind") in CACHE_KINDS and role in (*KV_ROLES, "q"):
            out.setdefault(module, {})[f"{role}_scale"] = entry["scale"]
    return out


def kv_granularity_from_report(report: dict | None) -> str | None:
    """``"tensor"`` / ``"head"`` when ``report`` holds KV-cache taps, else None."""
    return next((e.get("granularity", "tensor") for e in (report or {}).values()
                 if e.get("kind") == "kv"), None)


def query_modules_from_report(report: dict | None) -> list[str]:
    """The attention modules whose query is quantized as FP8 attention (``"query"`` taps)."""
    return [tap.rpartition(":")[0] for tap, e in (report or {}).items()
            if e.get("kind") == "query"]


def served_query_scale(scale: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The query scale vLLM quantizes with, given the calibrated one (``[1]`` or one per query
    head): a per-head ``q_scale`` is served per KV head, one scale for each group of
    ``num_heads // num_kv_heads`` query heads, so each group takes its largest head's scale
    (the only choice that clips none of the group's calibrated range). vLLM
    vllm/model_executor/layers/attention/attention.py (``Attention.__init__``: ``is_per_head =
    q_scale.numel() == num_kv_heads``, ``QuantFP8(static=True, group_shape=GroupShape(-1,
    head_size * num_heads // num_kv_heads))``) and docs/features/quantization/
    quantized_kvcache.md (``q_scale = [num_heads]`` in the checkpoint; per-head scales on the
    Flash Attention backend only). Returned per query head, ready to broadcast."""
    flat = scale.reshape(-1)
    if flat.numel() == 1 or kv_heads < 1 or flat.numel() % kv_heads:
        return flat if flat.numel() > 1 else flat.reshape(())
    groups = flat.numel() // kv_heads
    return flat.reshape(kv_heads, groups).amax(dim=1).repeat_interleave(groups)


__all__ = ["CACHE_KINDS", "KV_OBSERVER", "KV_ROLES", "attention_scales_from_report",
           "kv_granularity_from_report", "kv_scales_from_report", "number",
           "query_modules_from_report", "served_query_scale"]
