"""A causal LM as body + output layer, so log-likelihoods never need the whole logits tensor.

``model(ids, labels=ids)`` materializes [batch x context x vocabulary] float32 logits and, inside
the loss, a log-softmax of the same size: for SmolLM2 (49,152 tokens) at 4 x 512 that is ~0.8 GB
of transient memory in every perplexity probe of ``sensitivity`` / ``--target-delta``; for a
262,144-token vocabulary at context 2048 and batch 8, 17 GB twice. Here the body runs the
batch (hidden states are small) and the output layer + log-softmax run on at most
``CHUNK_ELEMENTS / vocabulary`` positions at a time. ``fp8ptq.evals``' lm-eval wrapper and
``fp8ptq.sensitivity.probes`` both score this way.

The split is only used after a check that body + output layer reproduce the model's own logits
on a few tokens (a model that post-processes its logits in a way not known here keeps the plain
path).
"""

from __future__ import annotations

import torch
from torch import nn

CHUNK_ELEMENTS = 1 << 25  # 32M float32 logits = 128 MB per chunk


def body_and_head(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(the base model that returns ``last_hidden_state``, the output layer), or Nones."""
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return body, head


def logits_of(model: nn.Module, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits of ``hidden`` positions, with the config's final soft-capping (Gemma 2)."""
    logits = head(hidden).float()
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def split_works(model: nn.Module, device=None) -> bool:
    """Whether body + output layer give the model's own logits (checked on 8 tokens)."""
    body, head = body_and_head(model)
    if body is None or head is None or body is model:
        return False
    if device is None:
        device = next(model.parameters()).device
    vocab = max(int(getattr(getattr(model, "config", None), "vocab_size", 8) or 8), 2)
    ids = torch.arange(1, 9, device=device).reshape(1, -1) % vocab
    try:
        with torch.no_grad():
            want = model(ids).logits.float()
            got = logits_of(model, head, body(ids).last_hidden_state)
    except (TypeError, ValueError, AttributeError):  # not a plain causal LM: the plain path
        return False
    return want.shape == got.shape and bool(torch.allclose(want, got, rtol=1e-5, atol=1e-5))


def positions_per_chunk(head: nn.Module, elements: int = CHUNK_ELEMENTS) -> int:
    vocab = head.weight.shape[0] if hasattr(head, "weight") else 1
    return max(1, elements // max(vocab, 1))


def next_token_nll(model: nn.Module, ids: torch.Tensor, elements: int = CHUNK_ELEMENTS
                   ) -> tuple[float, int]:
    """(summed negative log-likelihood of every next token of ``ids`` [batch, seq], in float64;
    the number of tokens scored): what ``model(ids, labels=ids).loss`` averages, without the
    batch's whole logits. The caller checks ``split_works`` first."""
    body, head = body_and_head(model)
    chunk = positions_per_chunk(head, elements)
    hidden = body(input_ids=ids, use_cache=False).last_hidden_state
    total = torch.zeros((), dtype=torch.float64)
    for b in range(ids.shape[0]):
        for p in range(0, ids.shape[1] - 1, chunk):
            end = min(p + chunk, ids.shape[1] - 1)
            logits = logits_of(model, head, hidden[b, p:end])
            target = ids[b, p + 1:end + 1]
            total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").double()
            del logits
    return float(total), ids.shape[0] * (ids.shape[1] - 1)


__all__ = ["CHUNK_ELEMENTS", "body_and_head", "logits_of", "split_works", "positions_per_chunk",
           "next_token_nll"]
