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
from fp8ptq.io.data import START_TOKENS, start_ids
from fp8ptq.model import lm_head
from fp8ptq.runtime.usage import available_bytes


@dataclass
class TaskOutcome:
    """What one task produced: flat ``metric -> value``, how it was measured, per-sample records."""

    metrics: dict[str, float]
    protocol: dict[str, Any]
    samples: list[dict] = field(default_factory=list, repr=False)


PREFIX_TOKENS = START_TOKENS


WINDOW_STARTS = ("first", "every")


class RollingDocs:
    """Rolling log-likelihood (before ``HFLM`` in the MRO) over the tokens ``scored_ids`` gives,
    and with ``window_start="every"`` every window opened by the prefix token.

    lm-eval encodes each document with the tokenizer's own special tokens and then puts the
    prefix token in front of it. A tokenizer that adds its BOS (gemma, Llama 3) then opens the
    document with two, and the second is scored as the document's first token, as in lm-eval's
    own HFLM (github.com/EleutherAI/lm-evaluation-harness/issues/3333). Here the tokenizer's
    own leading copy of the prefix token is taken off, so the model sees the one start token it
    is served with and the scored tokens are the text's.

    lm-eval opens only a document's first window with the prefix token; each later one opens
    with the text token before its first scored one (.../lm-evaluation-harness/issues/2382). A
    model that is always served after its BOS (gemma) meets a first position it never saw in
    training there. ``every``: windows one token shorter, each later one opened by the prefix
    token and that text token (the scored tokens are the same)."""

    _rolling = False
    _windowing = False  # lm-eval is cutting windows (one token shorter under ``every``)
    window_start = "first"

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        self._rolling = True
        self._windowing = self.window_start == "every"
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm)
        finally:
            self._rolling = self._windowing = False

    @property
    def max_length(self):
        return super().max_length - (1 if self._windowing else 0)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if self._windowing:  # lm-eval cuts every window before it scores any
            self._windowing = False
        if self._rolling and self.window_start == "every":
            start = self.prefix_token_id
            requests = [(key, ctx if ctx[:1] == [start] else [start, *ctx], cont)
                        for key, ctx, cont in requests]
        return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)

    def tok_encode(self, string, *args, **kwargs):
        ids = super().tok_encode(string, *args, **kwargs)
        return self._scored(ids) if self._rolling and ids else ids

    def scored_ids(self, text: str) -> list[int]:
        """The tokens of document ``text`` that rolling log-likelihood scores, in order."""
        return self._scored(super().tok_encode(text))

    def _scored(self, ids: list[int]) -> list[int]:
        start = self.prefix_token_id
        if ids and ids[0] == start and start in self.tokenizer.all_special_ids:
            return ids[1:]
        return ids


class NoPrefixDocs(RollingDocs):
    """Rolling log-likelihood without a prefix token: each document's first token is the
    context of the second and is not scored itself (lm-eval always prepends a prefix token;
    here that token is the document's own first one, taken off the scored tokens). For a
    tokenizer that adds its BOS that first token is the BOS."""

    _first = None

    def _scored(self, ids: list[int]) -> list[int]:
        if not ids:
            return ids
        # lm-eval encodes the document, then reads prefix_token_id for it
        self._first = ids[0]
        return ids[1:]

    @property
    def prefix_token_id(self) -> int:
        if self._rolling and self._first is not None:
            return self._first
        return super().prefix_token_id

    scored_offset = 1  # tokens of a document that are context, not scored


class NoPrefixHFLM(NoPrefixDocs, HFLM):
    pass


def prefix_token_id(tokenizer, choice: str = "auto") -> int | None:
    """The token that conditions the first token of every document in rolling log-likelihood:
    ``fp8ptq.io.data.start_ids``'s, the rule calibration windows open by (``auto``: the token
    the tokenizer adds, else a chat template's first token, else BOS, else EOS; ``bos`` /
    ``eos``: that token), so a model is scored on the first position it was calibrated on.
    None for ``none`` (``NoPrefixHFLM``) or a tokenizer with no such token."""
    if choice not in PREFIX_TOKENS:
        raise UsageError(f"--prefix-token must be one of {', '.join(PREFIX_TOKENS)}")
    ids = start_ids(tokenizer, choice)
    return ids[0] if ids else None


class ChunkedLogitsMixin:
    """Log-likelihoods without a [batch x context x vocabulary] float32 tensor.

    lm-eval's HFLM takes the log-softmax of the whole batch's logits at once: with a 262,144-
    token vocabulary, context 2048 and batch 8 that is 17 GB of float32, twice. Here the model's
    body runs the batch (hidden states are small), and the output layer + log-softmax run on
    at most ``CHUNK_ELEMENTS / vocabulary`` positions at a time, only for the positions whose
    next token is scored. Log-likelihoods equal HFLM's (float32 log-softmax, summed in float64;
    tested to 1e-6 relative). Before relying on the split the first call checks that body +
    output layer reproduce the model's own logits; a model that post-processes its logits in a
    way we do not know falls back to lm-eval's path."""

    CHUNK_ELEMENTS = lm_head.CHUNK_ELEMENTS

    _split_ok: bool | None = None

    def _body_and_head(self):
        return lm_head.body_and_head(self.model)

    def _logits_of(self, head, hidden):
        return lm_head.logits_of(self.model, head, hidden)

    def _check_split(self) -> bool:
        if self._split_ok is None:
            self._split_ok = lm_head.split_works(self.model, self.device)
        return self._split_ok

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if self.backend != "causal" or not self._check_split():
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        body, head = self._body_and_head()
        chunk = lm_head.positions_per_chunk(head, self.CHUNK_ELEMENTS)
        size = override_bs or (self.batch_size if isinstance(self.batch_size, int) else 1)
        order = sorted(range(len(requests)),
                       key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list = [None] * len(requests)
        for start in range(0, len(order), size):
            idx = order[start:start + size]
            inputs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1]
                      for i in idx]
            width = max(len(x) for x in inputs)
            batch = torch.zeros(len(idx), width, dtype=torch.long, device=self.device)
            for b, x in enumerate(inputs):
                batch[b, :len(x)] = torch.tensor(x, dtype=torch.long)
            with torch.no_grad():
                hidden = body(batch).last_hidden_state
                for b, i in enumerate(idx):
                    cont = requests[i][2]
                    n = len(inputs[b])
                    target = torch.tensor(cont[-n:], dtype=torch.long, device=self.device)
                    first = n - len(target)
                    total, greedy = 0.0, True
                    for p in range(0, len(target), chunk):
                        t = target[p:p + chunk]
                        logp = torch.log_softmax(self._logits_of(
                            head, hidden[b, first + p:first + p + len(t)]), dim=-1)
                        total += float(logp.gather(-1, t.unsqueeze(-1)).double().sum())
                        greedy = greedy and bool((logp.argmax(-1) == t).all())
                        del logp
                    out[i] = (total, greedy)
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out


class ChunkedHFLM(RollingDocs, ChunkedLogitsMixin, HFLM):
    pass


class ChunkedNoPrefixHFLM(NoPrefixDocs, ChunkedLogitsMixin, HFLM):
    pass


def auto_batch_size(model, seq_len: int, budget_fraction: float = 0.25) -> int:
    """Sequences per batch that fit in a quarter of the available memory: the body's
    activations (hidden states and one layer's attention scores) per sequence; the output layer
    is chunked (``ChunkedLogitsMixin``) so the vocabulary does not count."""
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 1024)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 16)
    per_sequence = seq_len * (hidden * 4 * 12 + heads * seq_len * 4 * 2)
    avail = available_bytes()
    if avail is None:
        return 8
    return int(max(1, min(64, budget_fraction * avail // max(per_sequence, 1))))


def check_windows(prefix_token: str, window_start: str) -> None:
    """Refuse a ``window_start`` that is unknown or that needs a prefix token there is not."""
    if window_start not in WINDOW_STARTS:
        raise UsageError(f"--window-start must be one of {', '.join(WINDOW_STARTS)}")
    if window_start == "every" and prefix_token == "none":
        raise UsageError("--window-start every opens each window with the prefix token: "
                         "not with --prefix-token none")


def make_lm(model, tokenizer, *, batch_size: int | None = 8, seq_len: int | None = None,
            prefix_token: str = "auto", window_start: str = "first") -> HFLM:
    """Wrap an already loaded causal LM; ``seq_len`` None lets lm-eval take it from the config;
    ``batch_size`` None chooses one from the free memory (``auto_batch_size``);
    ``window_start``: which rolling windows open with the prefix token (``RollingDocs``)."""
    check_windows(prefix_token, window_start)
    if batch_size is None:
        length = seq_len or getattr(getattr(model, "config", None), "max_position_embeddings",
                                    2048) or 2048
        batch_size = auto_batch_size(model, min(int(length), 8192))
    cls = ChunkedNoPrefixHFLM if prefix_token == "none" else ChunkedHFLM
    lm = cls(pretrained=model, tokenizer=tokenizer, max_length=seq_len, batch_size=batch_size,
             prefix_token_id=prefix_token_id(tokenizer, prefix_token))
    lm.window_start = window_start
    return lm


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

