"""Scoring the digits CNN testbed (``fp8ptq.vision``) quantized: top-1 accuracy and the output
error against the float model, for the direct / BN re-tuned / depthwise-kept comparisons."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..execution.in_memory import quantize_model
from ..vision import predict, relative_output_error


def quantize_and_score(model: nn.Module, recipe, batches, images: torch.Tensor,
                       labels: torch.Tensor) -> tuple[float, float, object]:
    """Quantize a copy of ``model`` per ``recipe`` (calibrating on ``batches``) and score it on
    ``images``: (top-1 accuracy, ``relative_output_error`` against ``model``, QuantizeResult)."""
    quantized = copy.deepcopy(model)
    result = quantize_model(quantized, recipe, batches)
    logits = predict(quantized, images)
    return (float((logits.argmax(-1) == labels).float().mean()),
            relative_output_error(logits, predict(model, images)), result)
