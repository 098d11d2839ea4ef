"""Model configs, model classes and the loaded-model record: a leaf module, so that loading a
model (``fp8ptq.io.loading``), building one without weights (``fp8ptq.io.weights``) and loading an
fp8ptq checkpoint (``fp8ptq.checkpoint.reader``) share them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
)

from ..errors import DataError, UsageError, first_line
from ..io.source import prequantized

TASK_CLASSES = {
    "causal-lm": AutoModelForCausalLM,
    "qa": AutoModelForQuestionAnswering,
    "seq-cls": AutoModelForSequenceClassification,
    "base": AutoModel,
}

REMOTE_CODE_HINTS = ("trust_remote_code", "custom code")


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


def load_config(source, location, *, as_served: bool = False, **hub_kwargs):
    """``AutoConfig.from_pretrained`` with its failures as one line: an architecture this
    transformers does not know, or a repository that ships its own code (refused unless
    ``trust_remote_code``). ``as_served``: keep another tool's ``quantization_config`` so that
    transformers applies it (a checkpoint evaluated as a runtime serves it)."""
    try:
        config = AutoConfig.from_pretrained(location, **hub_kwargs)
    except (ValueError, KeyError) as e:  # e.g. a model_type this transformers does not know
        if any(hint in str(e) for hint in REMOTE_CODE_HINTS):
            raise UsageError(f"refusing to run the code that model {source!r} ships with "
                             "(its config names its own Python modules); pass "
                             "--trust-remote-code (trust_remote_code=True) only if you trust "
                             "its source") from None
        raise DataError(f"cannot load model {source!r}: {first_line(e)}") from None
    if not as_served and Path(location).is_dir() and prequantized(location) is not None:
        # read as the float model it stands for (``SafetensorsSource``): no quantizer, and no
        # stale quantization_config in what fp8ptq writes
        del config.quantization_config
    return config
