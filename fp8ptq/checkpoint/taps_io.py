"""Activation taps (``--quantize-attention`` / ``--quantize-residual``) in checkpoints.

``fp8ptq.json`` ``taps`` holds the ``ActivationTaps.freeze`` report (every tap's scale, format,
statistics); ``fp8ptq.load`` re-installs the taps from it, so the reloaded model quantizes
Q/K/V/P and the residual-add inputs with the same scales. The KV-cache scales are also written
as tensors ``<attention module>.k_scale`` / ``.v_scale`` (float32 ``[1]``): always in the native
layout; in the compressed-tensors layout, together with ``kv_cache_scheme`` in config.json, where
compressed-tensors can use them (e4m3 / int8 taps, attention modules it treats as KV-cached:
Llama family, OPT, ...; not BERT's ``query/key/value``), so transformers / vLLM quantize the KV
cache with the same scales. FP8 attention (``--kv-cache fp8 --quantize-attention``) adds
``<attention module>.q_scale`` (``[1]`` or ``[num_heads, 1, 1]``) and, in compressed-tensors, a
config group targeting the attention classes, as llm-compressor writes attention quantization.
The simulation-only P and residual scales have no compressed-tensors counterpart. What a layout
does with the q/k/v tensors is its ``Layout.kv_cache``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import Fp8ptqError, NumericsError
from ..taps.tap_report import query_modules_from_report
from ..taps.taps import ActivationTaps, kv_granularity_from_report, kv_scales_from_report


def taps_report(result) -> dict | None:
    return (getattr(result, "extras", None) or {}).get("taps")


def kv_cache_export(model: nn.Module, report: dict | None, layout
                    ) -> tuple[dict[str, torch.Tensor], dict | None, str | None]:
    """(q/k/v scale tensors, ``kv_cache_scheme`` for the config or None, note for fp8ptq.json)
    for ``report``, the taps' ``freeze`` report (None: no taps), as ``layout`` (a
    ``layouts.Layout``) stores them."""
    if not report:
        return {}, None, None
    for name, entry in report.items():
        s = entry.get("scale")
        values = s if isinstance(s, list) and s else [s]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
            raise NumericsError(f"activation tap {name} has scale {s!r}; refusing to write a "
                                "checkpoint that would decode to NaN/inf/0")
    kv = kv_scales_from_report(report)
    if not kv:
        return {}, None, None
    tensors = {f"{a}.{k}": kv_scale_tensor(v) for a, s in kv.items() for k, v in s.items()}
    return layout.kv_cache(model, report, tensors)


def attention_targets(model: nn.Module, report: dict | None) -> list[str]:
    """The attention classes whose query FP8 attention quantizes (a config group's targets, as
    llm-compressor's ``QuantizationScheme(targets=["LlamaAttention"], ...)``); [] without."""
    return sorted({type(model.get_submodule(a)).__name__
                   for a in query_modules_from_report(report)})


def kv_scale_tensor(scale) -> torch.Tensor:
    """A Q / K / V scale as compressed-tensors' ``initialize_attn_qparams`` shapes it: ``[1]``
    per tensor, ``[heads, 1, 1]`` per head (strategy ``attn_head``: ``num_attention_heads`` for
    q_scale, ``num_key_value_heads`` for k/v_scale); float32."""
    t = torch.tensor(scale, dtype=torch.float32)
    return t.reshape(1) if t.dim() == 0 else t.reshape(-1, 1, 1)


def pop_kv_tensors(tensors: dict[str, torch.Tensor], report: dict | None, path) -> None:
    """Remove the k/v scale tensors from ``tensors`` (they are no model parameters), checking
    them against fp8ptq.json where they were written."""
    for attn, scales in kv_scales_from_report(report or {}).items():
        for key, want in scales.items():
            t = tensors.pop(f"{attn}.{key}", None)
            if t is not None and not torch.equal(t.float().reshape(-1),
                                                 kv_scale_tensor(want).reshape(-1)):
                raise Fp8ptqError(f"checkpoint {path}: {attn}.{key} = {t.reshape(-1).tolist()} "
                                  f"but fp8ptq.json says {want}")


def install_taps(model: nn.Module, report: dict | None) -> ActivationTaps | None:
    """Re-install the activation taps that ``report`` describes, with its scales."""
    if not report:
        return None
    kinds = {e.get("kind") for e in report.values()}
    taps = ActivationTaps(model, attention="attention" in kinds, residual="residual" in kinds,
                          kv=kv_granularity_from_report(report), query="query" in kinds)
    taps.restore(report)
    return taps
