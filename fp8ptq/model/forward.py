"""Running calibration batches through a model: a leaf module, so that the pipeline and every
stage it drives (SmoothQuant, BN re-tuning, layer-aware calibrators) share it without importing
each other."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def run_batch(model: nn.Module, batch):
    """One forward pass: keyword inputs (token batches) or one positional tensor (images)."""
    return model(**batch) if isinstance(batch, dict) else model(batch)


def token_batches(input_ids: torch.Tensor, batch_size: int, device="cpu") -> Iterable[dict]:
    for i in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[i:i + batch_size].to(device)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
