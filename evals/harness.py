"""The thin layer over lm-eval shared by every task: one HFLM, one evaluate call, flat metrics."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lm_eval import evaluator, simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from fp8ptq.errors import UsageError


@dataclass
class TaskOutcome:
    """What one task produced: flat ``metric -> value``, how it was measured, per-sample records."""

    metrics: dict[str, float]
    protocol: dict[str, Any]
    samples: list[dict] = field(default_factory=list, repr=False)


PREFIX_TOKENS = ("auto", "bos", "eos", "none")


class NoPrefixHFLM(HFLM):
    """Rolling log-likelihood without a prefix token: each document's first token is the
    context of the second and is not scored itself (lm-eval always prepends a prefix token;
    here that token is the document's own first one, taken off the scored tokens)."""

    _rolling = False
    _first = None

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        self._rolling = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm)
        finally:
            self._rolling = False

    def tok_encode(self, string, *args, **kwargs):
        ids = super().tok_encode(string, *args, **kwargs)
        if self._rolling and ids:
            # lm-eval encodes the document, then reads prefix_token_id for it
            self._first = ids[0]
            return ids[1:]
        return ids

    @property
    def prefix_token_id(self) -> int:
        if self._rolling and self._first is not None:
            return self._first
        return super().prefix_token_id

    scored_offset = 1  # tokens of a document that are context, not scored


def prefix_token_id(tokenizer, choice: str = "auto") -> int | None:
    """The token that conditions the first token of every document in rolling log-likelihood.

    ``auto``: the BOS the tokenizer itself adds when it encodes text, else lm-eval's convention
    (None here: BOS if the tokenizer has one, EOS otherwise). ``bos`` / ``eos``: that token."""
    if choice not in PREFIX_TOKENS:
        raise UsageError(f"--prefix-token must be one of {', '.join(PREFIX_TOKENS)}")
    if choice == "none":
        return None
    if choice == "auto":
        bos = tokenizer.bos_token_id
        ids = tokenizer("a").get("input_ids") or []
        return bos if bos is not None and ids and ids[0] == bos else None
    token = tokenizer.bos_token_id if choice == "bos" else tokenizer.eos_token_id
    if token is None:
        raise UsageError(f"--prefix-token {choice}: the tokenizer has no {choice.upper()} token")
    return token


def make_lm(model, tokenizer, *, batch_size: int = 8, seq_len: int | None = None,
            prefix_token: str = "auto") -> HFLM:
    """Wrap an already loaded causal LM; ``seq_len`` None lets lm-eval take it from the config."""
    cls = NoPrefixHFLM if prefix_token == "none" else HFLM
    return cls(pretrained=model, tokenizer=tokenizer, max_length=seq_len, batch_size=batch_size,
               prefix_token_id=prefix_token_id(tokenizer, prefix_token))


@contextmanager
def float32_logits(model):
    """Hand lm-eval float32 logits. HFLM takes log_softmax and sums log-likelihoods in the
    model's dtype: in bf16 a 1,500-token document's sum (~ -4000) is rounded to a multiple of 16,
    which quantizes perplexity in ~1% steps and makes different models score identically."""

    def hook(_module, _args, output):
        logits = getattr(output, "logits", None)
        if logits is not None and logits.dtype != torch.float32:
            output.logits = logits.float()
        return output

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def evaluate(
    lm: HFLM,
    task: str | dict,
    *,
    limit: int | None = None,
    task_manager: TaskManager | None = None,
) -> tuple[dict, dict[str, list[dict]]]:
    """Run one task (a registered name or an inline config dict); returns (results, samples).

    ``results`` is lm-eval's ``results["results"]`` (task name -> {"metric,filter": value}).
    Inline configs (which set their own ``num_fewshot``) skip ``simple_evaluate``'s task defaults
    and its environment report (a ``collect_env`` subprocess, ~1 s).
    """
    task_manager = task_manager or TaskManager(include_defaults=False)
    # no stderr: bootstrapping costs more than the run itself on small tasks
    if isinstance(task, dict):
        out = evaluator.evaluate(
            lm, task_manager.load([task]), limit=limit, bootstrap_iters=0, log_samples=True
        )
    else:
        out = simple_evaluate(
            model=lm, tasks=[task], limit=limit, task_manager=task_manager,
            bootstrap_iters=0, log_samples=True,
        )
    return out["results"], out.get("samples", {})


def flatten_metrics(task_results: dict[str, Any]) -> dict[str, float]:
    """``{"word_perplexity,none": 21.4, "acc_stderr,none": ...}`` -> ``{"word_perplexity": 21.4}``.

    Stderr entries are dropped; a filter other than ``none`` is kept as ``metric[filter]``.
    """
    flat = {}
    for key, value in task_results.items():
        if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        metric, filter_name = key.split(",", 1)
        if metric.endswith("_stderr"):
            continue
        flat[metric if filter_name == "none" else f"{metric}[{filter_name}]"] = float(value)
    return flat

