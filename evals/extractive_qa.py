"""Span prediction for ``*ForQuestionAnswering`` models (transformers 5 has no QA pipeline).

Standard SQuAD v1.1 post-processing, as in transformers' ``run_qa`` example: contexts longer
than ``max_length`` become overlapping windows (``stride`` tokens shared); per window the
``n_best`` start and end logits form candidate spans inside the context, at most
``max_answer_length`` tokens long; the best start+end logit over all windows wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from fp8ptq.errors import UsageError


@dataclass(frozen=True)
class SpanSettings:
    max_length: int = 384
    stride: int = 128
    n_best: int = 20
    max_answer_length: int = 30

    def as_protocol(self) -> dict:
        return asdict(self)


def is_extractive_qa(model) -> bool:
    return type(model).__name__.endswith("ForQuestionAnswering")


def predict_answers(
    model,
    tokenizer,
    examples: Sequence[dict],
    *,
    batch_size: int = 32,
    settings: SpanSettings = SpanSettings(),
) -> list[str]:
    """The answer text for each ``{"question", "context"}`` in ``examples``, in order."""
    if not getattr(tokenizer, "is_fast", False):
        raise UsageError("extractive QA needs a fast tokenizer (offset mappings)")
    answers = []
    for start in range(0, len(examples), batch_size):
        answers += _predict_batch(model, tokenizer, examples[start : start + batch_size], settings)
    return answers


@torch.inference_mode()
def _predict_batch(model, tokenizer, examples: Sequence[dict], settings: SpanSettings) -> list[str]:
    contexts = [e["context"] for e in examples]
    encoding = tokenizer(
        [e["question"].lstrip() for e in examples],
        contexts,
        truncation="only_second",
        max_length=settings.max_length,
        stride=settings.stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding=True,
        return_tensors="pt",
    )
    window_example = encoding.pop("overflow_to_sample_mapping").tolist()
    offsets = encoding.pop("offset_mapping").tolist()
    in_context = torch.tensor(
        [[sid == 1 for sid in encoding.sequence_ids(i)] for i in range(len(window_example))]
    )
    outputs = model(**{name: tensor.to(model.device) for name, tensor in encoding.items()})
    start_logits = outputs.start_logits.float().cpu()
    end_logits = outputs.end_logits.float().cpu()

    best: list[tuple[float, str]] = [(float("-inf"), "")] * len(examples)
    for window, example in enumerate(window_example):
        candidate = _best_span(start_logits[window], end_logits[window], in_context[window],
                               settings)
        if candidate is not None and candidate[0] > best[example][0]:
            first, last = candidate[1], candidate[2]
            text = contexts[example][offsets[window][first][0] : offsets[window][last][1]]
            best[example] = (candidate[0], text)
    return [text for _, text in best]


def _best_span(start_logits, end_logits, in_context, settings: SpanSettings):
    """(score, first token, last token) of the best valid span among the n-best, or None."""
    n = min(settings.n_best, start_logits.numel())
    starts = start_logits.topk(n).indices
    ends = end_logits.topk(n).indices
    scores = start_logits[starts][:, None] + end_logits[ends][None, :]
    length = ends[None, :] - starts[:, None] + 1
    valid = (
        in_context[starts][:, None]
        & in_context[ends][None, :]
        & (length >= 1)
        & (length <= settings.max_answer_length)
    )
    if not valid.any():
        return None
    flat = scores.masked_fill(~valid, float("-inf")).argmax()
    i, j = divmod(int(flat), n)
    return float(scores[i, j]), int(starts[i]), int(ends[j])
