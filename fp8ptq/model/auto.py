"""Model configs, model classes and the loaded-model record: a leaf module, so that loading a
model (``fp8ptq.io.loading``), building one without weights (``fp8ptq.io.weights``) and loading an
fp8ptq checkpoint (``fp8ptq.checkpoint.reader``) share them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
)

TASK_CLASSES = {
    "causal-lm": AutoModelForCausalLM,
    "qa": AutoModelForQuestionAnswering,
    "seq-cls": AutoModelForSequenceClassification,
    "base": AutoModel,
}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    source: str  # what the user passed
    kind: str  # "hub" | "local" | "gguf" | "torch" ("fp8ptq" from checkpoint.load_quantized)
    resolved_path: str  # local folder, hub id, or for a .gguf its dequantized copy in the cache


# transformers' class-name suffixes of a causal language model (its first token attends to
# itself alone): what picks the Auto class, the card's pipeline tag and sink-aware GPTQ's default
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_causal_lm_name(name: str) -> bool:
    """``name`` (an architecture or model class name) is a causal language model's."""
    return name.endswith(CAUSAL_LM_SUFFIXES)


def model_class(config, task: str | None = None):
    """The Auto class for ``config``: ``task`` if given, else by ``config.architectures``."""
    if task is not None:
        return TASK_CLASSES[task]
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch.endswith("ForQuestionAnswering"):
            return AutoModelForQuestionAnswering
        if arch.endswith("ForSequenceClassification"):
            return AutoModelForSequenceClassification
        if is_causal_lm_name(arch):
            return AutoModelForCausalLM
    return AutoModel

