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
    itself (``--quantize-lm-head``) pass ``logits=head_observed(...)``. Such a pass also
    builds no KV cache (``use_cache=False``, where the forward takes it): nothing decodes after
    it, and the cache of every layer would stay allocated until the forward returns (on an
    8B-shaped Llama, 8 x 512 bf16 tokens: 0.5 GiB of GPU memory)."""
    if isinstance(batch, Mapping):
        if not logits and _accepts(model, "logits_to_keep"):
            extra = {"use_cache": False} if _accepts(model, "use_cache") else {}
            return model(**batch, logits_to_keep=1, **extra)
        return model(**batch)
    return model(batch)


# Tokens one statistics-pass forward runs at once (``micro_batches``). A forward's activations
# and their allocator churn scale with its tokens, so smaller forwards lower the calibration
# peak (docs/results/speed.md, "Other figures behind code comments"). 2048, not 1024: at two
# threads the same forward split into 1,024-token pieces took 1.09x the whole-batch forward's
# CPU time (more, shorter parallel regions), into 2,048-token pieces 0.98x
# (docs/results/speed.md, "Main job: work removed (2026-11-28)").
MICRO_TOKENS = 2048


def micro_batches(batch, tokens: int | None = None, multiple: int = 1) -> list:
    """``batch`` split along its first (sequence) dimension into pieces of whole sequences of
    about ``tokens`` tokens, each holding a multiple of ``multiple`` tokens (so every
    ``multiple``-th row of the pieces is every ``multiple``-th row of the batch); ``[batch]``
    when it is small enough or cannot be split.

    ``batch`` is a mapping of keyword inputs whose first tensor sets the batch (``input_ids``
    of a token batch; ``hidden_states`` of a block's recorded inputs in sequential mode, whose
    other arguments are masks, positions and rotary tables). Each value is split when its first
    dimension is the batch's, kept whole when it is 1 (broadcast over the batch, e.g. rotary
    tables of shared positions) or not a tensor (``None``, flags); tuples and lists are split
    element by element. Anything else (images, a tensor with another first dimension) is not
    split. A piece's forward computes each sequence as the whole batch's does (each sequence
    attends to itself only); the statistics that add exactly (amax, histograms) and a block's
    outputs are then the same bit for bit (tested)."""
    return [piece for _, piece in micro_batch_spans(batch, tokens, multiple)]


def micro_batch_spans(batch, tokens: int | None = None, multiple: int = 1
                      ) -> list[tuple[int, object]]:
    """``micro_batches`` with each piece's first row in the batch: ``[(start, piece), ...]``,
    so that a caller writing the pieces' outputs into one batch tensor (``run_block``) takes
    the offsets from the split itself instead of recomputing them; ``[(0, batch)]`` when the
    batch stays whole."""
    tokens = MICRO_TOKENS if tokens is None else tokens
    if not isinstance(batch, Mapping) or not batch:
        return [(0, batch)]
    items = list(batch.items())
    first = next((v for _, v in items if torch.is_tensor(v)), None)
    if first is None or first.dim() < 1:
        return [(0, batch)]
    n = first.shape[0]
    if not all(_splittable(v, n) for _, v in items):
        return [(0, batch)]
    seq = first.shape[1] if first.dim() > 1 else 1
    rows = max(1, tokens // max(1, seq))
    while rows < n and (rows * seq) % multiple:
        rows += 1
    if rows >= n:
        return [(0, batch)]
    return [(i, {k: _piece(v, n, i, rows) for k, v in items}) for i in range(0, n, rows)]


def _splittable(value, n: int) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_splittable(v, n) for v in value)
    if torch.is_tensor(value):
        return value.dim() >= 1 and value.shape[0] in (n, 1)
    return True


def _piece(value, n: int, start: int, rows: int):
    if isinstance(value, (tuple, list)):
        return type(value)(_piece(v, n, start, rows) for v in value)
    if torch.is_tensor(value) and value.shape[0] == n and n > 1:
        return value[start:start + rows]
    return value


def head_observed(model: nn.Module, modules: Iterable[nn.Module]) -> bool:
    """Whether the model's output head (``get_output_embeddings()``) is among ``modules``, i.e.
    a calibration pass must compute it for every position."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head is not None and any(m is head for m in modules)


_ACCEPTS: dict[tuple[type, str], bool] = {}


def _accepts(model: nn.Module, argument: str) -> bool:
    """Whether ``model``'s forward takes the keyword ``argument`` (looked up once per class)."""
    key = (type(model), argument)
    if key not in _ACCEPTS:
        try:
            _ACCEPTS[key] = argument in inspect.signature(key[0].forward).parameters
        except (TypeError, ValueError):
            _ACCEPTS[key] = False
    return _ACCEPTS[key]


def token_batches(input_ids: torch.Tensor, batch_size: int, device="cpu") -> Iterable[dict]:
    for i in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[i:i + batch_size].to(device)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def clone_output(out):
    """A detached copy of a module's output: tensors cloned, tuples element by element,
    anything else (None, flags) as it is. For outputs recorded now and handed out later
    (``lm_probes``' layer replay, ``fp8ptq.algorithms.gptq.replay``), which later in-place updates
    must not
    reach."""
    if torch.is_tensor(out):
        return out.detach().clone()
    if isinstance(out, tuple):
        return tuple(clone_output(o) for o in out)
    return out


def output_nbytes(out) -> int:
    """Bytes of the tensors in a module's output (tuples summed, anything else 0)."""
    if torch.is_tensor(out):
        return out.numel() * out.element_size()
    return sum(output_nbytes(o) for o in out) if isinstance(out, tuple) else 0

