"""Cheap model-level measurements for ``fp8ptq.sensitivity``.

``PerplexityProbe``: perplexity of fixed token windows, the loss ``model(input_ids,
labels=input_ids)`` averages, scored without the batch's whole logits (``fp8ptq.model.lm_head``:
for SmolLM2 at 4 x 512 tokens the float32 logits and their log-softmax would be ~0.8 GB).
When a change is confined to decoder layers >= k, the layers before k are replayed from outputs
cached in the baseline pass instead of being run again (checked once: replaying every layer but
the last must reproduce the baseline loss, else every evaluation runs the whole model).
``KLProbe``: the mean KL divergence of the next-token distributions against the unquantized
model's (recorded by its baseline pass as top-k log-probs + tail mass), scored in the same chunks.
``LogitsProbe``: SQNR of the logits against the high-precision logits.

Both run bf16 / fp16 GEMMs in float32 on CPUs without a fast kernel for them
(``fp8ptq.model.gemm32``, as every forward of ``quantize`` does): a bf16 model's probe pass
is several times faster there, and a unit's measured delta is then the one ``quantize``'s own
calibration forwards would see.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import DataError, UsageError
from ..formats.scales import sqnr_db
from ..model.forward import clone_output, output_nbytes
from ..model.gemm32 import float32_gemms
from ..model.lm_head import (
    body_and_head,
    logits_of,
    next_token_nll,
    positions_per_chunk,
    split_works,
)

REPLAY_CACHE_BYTES = 4 * 2**30


class _Replay(nn.Module):
    """Stands in for a decoder layer: returns a cached output, reads other attributes from the
    layer it replaces (held outside ``_modules`` so its parameters are not registered twice)."""

    def __init__(self, layer: nn.Module, output):
        super().__init__()
        self.__dict__["_layer"] = layer
        self._output = output

    def forward(self, *args, **kwargs):
        return self._output()

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"], name)


class PerplexityProbe:
    """Perplexity of fixed token windows; ``probe(layer)`` replays decoder layers < ``layer``
    from the outputs cached by ``baseline()`` (nothing before a unit changes when it is
    quantized)."""

    metric = "ppl"

    def __init__(self, model: nn.Module, windows: torch.Tensor, batch_size: int = 4,
                 stack: nn.ModuleList | None = None):
        if windows.dim() != 2 or windows.shape[1] < 2:
            raise DataError("perplexity windows must be [n, seq_len] with seq_len >= 2")
        device = next(model.parameters()).device
        self.model, self.stack = model, stack
        self.batches = [w.to(device) for w in windows.split(max(1, batch_size))]
        self.cache: list[list] | None = None
        self.split: bool | None = None  # body + output layer scored in chunks (checked once)
        self.notes: list[str] = []
        self._batch = 0

    def _run(self) -> float:
        total, count = 0.0, 0
        with torch.inference_mode(), float32_gemms(model=self.model):
            self._check_split()
            for b, ids in enumerate(self.batches):
                self._batch = b
                if self.split:  # never the batch's whole logits (fp8ptq.model.lm_head)
                    nll, n = next_token_nll(self.model, ids)
                    total += nll
                    count += n
                    continue
                try:
                    out = self.model(input_ids=ids, labels=ids, use_cache=False)
                except (TypeError, ValueError) as e:
                    raise UsageError("--metric ppl needs a causal language model "
                                     f"({type(self.model).__name__}: {e}); use --metric sqnr") \
                        from None
                if getattr(out, "loss", None) is None:
                    raise UsageError(f"{type(self.model).__name__} returns no loss for labels; "
                                     "--metric ppl needs a causal language model, use --metric "
                                     "sqnr")
                n = ids.shape[0] * (ids.shape[1] - 1)
                total += float(out.loss) * n
                count += n
        return math.exp(total / count)

    def _check_split(self) -> None:
        # before any hook records layer outputs: the check runs the model on 8 tokens
        if self.split is None:
            with torch.inference_mode(), float32_gemms(model=self.model):
                self.split = split_works(self.model)

    def baseline(self) -> float:
        self._check_split()
        if self.stack is None or len(self.stack) < 2:
            return self._run()
        # outputs of every layer but the last (a run that changes nothing is not replayed)
        cache, size = [[] for _ in self.stack[:-1]], [0]

        def capture(j):
            def hook(_module, _args, out):
                size[0] += output_nbytes(out)
                if size[0] <= REPLAY_CACHE_BYTES:
                    cache[j].append(clone_output(out))
            return hook

        handles = [layer.register_forward_hook(capture(j))
                   for j, layer in enumerate(self.stack[:-1])]
        try:
            base = self._run()
        finally:
            for h in handles:
                h.remove()
        if size[0] > REPLAY_CACHE_BYTES:
            self.notes.append(f"layer outputs ({size[0] / 2**30:.1f} GiB) exceed the replay cache"
                              "; every evaluation runs the whole model")
            return base
        self.cache = cache
        check = self(len(self.stack) - 1)
        if check != base and not math.isclose(check, base, rel_tol=1e-6):
            self.cache = None
            self.notes.append(f"replaying cached layer outputs did not reproduce the baseline "
                              f"({check:.6g} vs {base:.6g}); every evaluation runs the whole model")
        return base

    def __call__(self, layer: int | None = None) -> float:
        if not layer or self.cache is None:
            return self._run()
        originals = [self.stack[j] for j in range(layer)]
        cached = self.cache[layer - 1]
        try:
            for j, module in enumerate(originals):
                self.stack[j] = _Replay(module, lambda: cached[self._batch])
            return self._run()
        finally:
            for j, module in enumerate(originals):
                self.stack[j] = module


class LogitsProbe:
    """SQNR (dB) of the model's logits against the high-precision logits of the same ids."""

    metric = "logits_sqnr_db"

    def __init__(self, model: nn.Module, input_ids: torch.Tensor):
        self.model = model
        self.ids = input_ids.to(next(model.parameters()).device)
        self.ref = None

    def _logits(self):
        with torch.inference_mode(), float32_gemms(model=self.model):
            out = self.model(input_ids=self.ids)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits.float()

    def baseline(self) -> float:
        self.ref = self._logits()
        return math.inf

    def __call__(self, layer: int | None = None) -> float:
        return sqnr_db(self.ref, self._logits())


# ---------------------------------------------------------------------------------------------
# KL divergence against the unquantized model's next-token distributions

TOP_K = 256  # reference log-probs kept per position (the rest as one tail bucket)


def _tail_logp(logp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """log of the probability mass outside ``idx`` (per row), from the full log-probs, without
    cancellation (a logsumexp over the masked rows, not log(1 - sum))."""
    if idx.shape[-1] >= logp.shape[-1]:
        return torch.full(logp.shape[:-1], -math.inf, dtype=logp.dtype, device=logp.device)
    return logp.scatter(-1, idx, -math.inf).logsumexp(-1)


def coarse_kl(ref_logp: torch.Tensor, ref_tail: torch.Tensor, logq_top: torch.Tensor,
              q_tail: torch.Tensor) -> torch.Tensor:
    """Per position KL(p || q) of the distributions coarsened to the reference's top-k tokens
    plus one tail bucket: sum_k p_k (log p_k - log q_k) + P_tail (log P_tail - log Q_tail).
    Merging tokens never increases a KL (log-sum inequality), so this is a lower bound of the
    full-vocabulary KL, short of it by exactly P_tail x KL(p | tail || q | tail): the tail's
    own mismatch, weighted by a mass that is small when k covers the likely tokens; exact when
    k >= the vocabulary."""
    p = ref_logp.exp()
    kl = (p * (ref_logp - logq_top)).sum(-1)
    tail = ref_tail.exp()
    has_tail = tail > 0
    tail_term = torch.where(has_tail, tail * (ref_tail - q_tail), torch.zeros_like(tail))
    return kl + tail_term


class KLProbe(PerplexityProbe):
    """Mean KL(p_float || q_model) of the next-token distributions on fixed token windows, in
    nats per token, against the distributions recorded by ``baseline()`` (the unquantized
    model). Why not the perplexity delta: that sums signed per-token log-likelihood changes,
    which cancel, so a block whose effect is small measures mostly noise (on SmolLM2 several
    blocks measure a negative delta on 4,096 tokens, docs/results/studies.md). KL is non-negative
    per token and, for a calibrated model (text ~ p_float), its mean is the expected log-likelihood
    increase: the predicted perplexity ratio of a set of units is exp(sum of their KLs).

    Memory: per scored position the reference keeps ``top_k`` log-probs and token ids plus the
    log of the remaining mass (``coarse_kl``: a lower bound short of the full KL by the tail's
    own mismatch), never the [tokens x vocabulary] log-probs (SmolLM2: 805 MB at 4,096 tokens;
    here 8 MB at k = 256). Every call also scores the perplexity (``last_ppl``) from the same
    logits, and ``baseline()`` returns the unquantized perplexity like ``PerplexityProbe``'s."""

    metric = "kl"

    def __init__(self, model: nn.Module, windows: torch.Tensor, batch_size: int = 4,
                 stack: nn.ModuleList | None = None, top_k: int = TOP_K):
        super().__init__(model, windows, batch_size, stack)
        if top_k < 1:
            raise UsageError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self.ref: dict[int, list] = {}
        self.last_ppl: float | None = None
        self.last_kl: float | None = None
        self._recording = False
        self._report_ppl = False

    def baseline(self) -> float:
        """Records the reference distributions; returns the unquantized perplexity (the
        replay check compares perplexities, like ``PerplexityProbe``'s)."""
        self.ref, self._recording, self._report_ppl = {}, True, True
        try:
            return super().baseline()  # the first _run records, the replay check compares
        finally:
            self._recording = self._report_ppl = False

    def _logits(self, ids: torch.Tensor):
        """Float32 logits of every scored position, row by row in chunks."""
        body, head = body_and_head(self.model)
        if self.split:
            hidden = body(input_ids=ids, use_cache=False).last_hidden_state
            chunk = positions_per_chunk(head)
            for r in range(ids.shape[0]):
                for p in range(0, ids.shape[1] - 1, chunk):
                    end = min(p + chunk, ids.shape[1] - 1)
                    yield r, p, end, logits_of(self.model, head, hidden[r, p:end])
            return
        try:
            logits = self.model(input_ids=ids, use_cache=False).logits
        except (TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"--target-metric kl needs a causal language model "
                             f"({type(self.model).__name__}: {e})") from None
        for r in range(ids.shape[0]):
            yield r, 0, ids.shape[1] - 1, logits[r, :-1].float()

    def _run(self) -> float:
        nll, kl, count = 0.0, 0.0, 0
        with torch.inference_mode(), float32_gemms(model=self.model):
            self._check_split()
            for b, ids in enumerate(self.batches):
                self._batch = b
                record = self._recording and b not in self.ref
                if b not in self.ref and not record:
                    raise UsageError("KLProbe: call baseline() on the unquantized model first")
                parts = self.ref.setdefault(b, []) if record else self.ref[b]
                for n, (r, p, end, logits) in enumerate(self._logits(ids)):
                    logp = torch.log_softmax(logits, dim=-1)
                    target = ids[r, p + 1:end + 1]
                    nll -= float(logp.gather(-1, target[:, None]).sum(dtype=torch.float64))
                    count += end - p
                    if record:
                        top, idx = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
                        parts.append((top, idx, _tail_logp(logp, idx)))
                        continue
                    top, idx, tail = parts[n]
                    kl += float(coarse_kl(top, tail, logp.gather(-1, idx),
                                          _tail_logp(logp, idx)).sum(dtype=torch.float64))
                    del logp, logits
        self.last_ppl, self.last_kl = math.exp(nll / count), kl / count
        return self.last_ppl if self._report_ppl else self.last_kl
