"""Running calibration batches through a model: a leaf module, so that the pipeline and every
stage it drives (SmoothQuant, BN re-tuning, layer-aware calibrators) share it without importing
each other."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping

import torch
from torch import nn


def run_batch(model: nn.Module, batch, *, logits: bool = True):
    """One forward pass: keyword inputs (token batches) or one positional tensor (images).

    ``logits=False`` is for passes that only observe modules through hooks (calibration): a
    causal LM then runs its output head on the last position alone (transformers'
    ``logits_to_keep=1``) instead of producing batch x sequence x vocabulary logits nobody
    reads - 402 MB of bf16 per 8 x 512 batch for SmolLM2's 49,152-token vocabulary, the
    largest single allocation of a calibration pass. Callers whose hooks observe the head
    itself (``--quantize-lm-head``) pass ``logits=head_observed(...)``."""
    if isinstance(batch, Mapping):
        if not logits and _keeps_logits(model):
            return model(**batch, logits_to_keep=1)
        return model(**batch)
    return model(batch)


def head_observed(model: nn.Module, modules: Iterable[nn.Module]) -> bool:
    """Whether the model's output head (``get_output_embeddings()``) is among ``modules``, i.e.
    a calibration pass must compute it for every position."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head is not None and any(m is head for m in modules)


_KEEPS: dict[type, bool] = {}


def _keeps_logits(model: nn.Module) -> bool:
    cls = type(model)
    if cls not in _KEEPS:
        try:
            _KEEPS[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            _KEEPS[cls] = False
    return _KEEPS[cls]


def token_batches(input_ids: torch.Tensor, batch_size: int, device="cpu") -> Iterable[dict]:
    for i in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[i:i + batch_size].to(device)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
