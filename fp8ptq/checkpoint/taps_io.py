"""Activation taps (``--quantize-attention`` / ``--quantize-residual``) in checkpoints.

``fp8ptq.json`` ``taps`` holds the ``ActivationTaps.freeze`` report (every tap's scale, format,
statistics); ``fp8ptq.load`` re-installs the taps from it, so the reloaded model quantizes
Q/K/V/P and the residual-add inputs with the same scales. The KV-cache scales are also written
as tensors ``<attention module>.k_scale`` / ``.v_scale`` (float32 ``[1]``): always in the native
layout; in the compressed-tensors layout, together with ``kv_cache_scheme`` in config.json, where
compressed-tensors can use them (e4m3 / int8 taps, attention modules it treats as KV-cached:
Llama family, OPT, ...; not BERT's ``query/key/value``), so transformers / vLLM quantize the KV
cache with the same scales. Q, P and residual scales have no compressed-tensors counterpart.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import Fp8ptqError, NumericsError
from ..formats import get_format
from ..taps import ActivationTaps, kv_scales_from_report
from .layout import LAYOUT_CT, ct_type


def taps_report(result) -> dict | None:
    return (getattr(result, "extras", None) or {}).get("taps")


def _cached_attention(module: nn.Module) -> bool:
    """Would compressed-tensors' ``kv_cache_scheme`` give this module k_scale / v_scale?"""
    try:
        from compressed_tensors.quantization.lifecycle.initialize import \
            is_cached_attention_module
    except ImportError:  # older compressed-tensors: no KV-cache scales written
        return False
    return bool(is_cached_attention_module(module))


def kv_cache_export(model: nn.Module, report: dict | None, layout: str
                    ) -> tuple[dict[str, torch.Tensor], dict | None, str | None]:
    """(k/v scale tensors, compressed-tensors ``kv_cache_scheme`` or None, note for
    fp8ptq.json) for ``report``, the taps' ``freeze`` report (None: no taps)."""
    if not report:
        return {}, None, None
    for name, entry in report.items():
        s = entry.get("scale")
        if not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise NumericsError(f"activation tap {name} has scale {s!r}; refusing to write a "
                                "checkpoint that would decode to NaN/inf/0")
    kv = kv_scales_from_report(report)
    if not kv:
        return {}, None, None
    tensors = {f"{a}.{k}": torch.tensor([s[k]], dtype=torch.float32)
               for a, s in kv.items() for k in ("k_scale", "v_scale")}
    if layout != LAYOUT_CT:
        return tensors, None, "tensors <attention>.k_scale / .v_scale (all taps: fp8ptq.json)"
    fmt = get_format(next(iter(report.values()))["format"])
    kv_type = ct_type(fmt)
    if kv_type is None:
        return {}, None, f"not written: compressed-tensors has no KV-cache type for {fmt.name}"
    odd = [a for a in kv if not _cached_attention(model.get_submodule(a))]
    if odd:
        return {}, None, (f"not written: compressed-tensors does not treat {odd[0]} as a "
                          "KV-cached attention module (all taps: fp8ptq.json)")
    scheme = {"num_bits": 8, "type": kv_type, "symmetric": True, "group_size": None,
              "strategy": "tensor", "dynamic": False}
    return tensors, scheme, "kv_cache_scheme + tensors <attention>.k_scale / .v_scale"


def pop_kv_tensors(tensors: dict[str, torch.Tensor], report: dict | None, path) -> None:
    """Remove the k/v scale tensors from ``tensors`` (they are no model parameters), checking
    them against fp8ptq.json where they were written."""
    for attn, scales in kv_scales_from_report(report or {}).items():
        for key, want in scales.items():
            t = tensors.pop(f"{attn}.{key}", None)
            if t is not None and float(t.reshape(-1)[0]) != want:
                raise Fp8ptqError(f"checkpoint {path}: {attn}.{key} = {float(t.reshape(-1)[0])} "
                                  f"but fp8ptq.json says {want}")


def install_taps(model: nn.Module, report: dict | None) -> ActivationTaps | None:
    """Re-install the activation taps that ``report`` describes, with its scales."""
    if not report:
        return None
    kinds = {e.get("kind") for e in report.values()}
    taps = ActivationTaps(model, attention="attention" in kinds, residual="residual" in kinds)
    taps.restore(report)
    return taps
