"""Cheap model-level measurements for ``fp8ptq.sensitivity``.

``PerplexityProbe``: perplexity of fixed token windows, the loss ``model(input_ids,
labels=input_ids)`` averages, scored without the batch's whole logits (``fp8ptq.model.lm_head``:
SmolLM2's 4 x 512 x 49,152 float32 logits and their log-softmax were ~0.8 GB of every probe).
When a change is confined to decoder layers >= k, the layers before k are replayed from outputs
cached in the baseline pass instead of being run again (checked once: replaying every layer but
the last must reproduce the baseline loss, else every evaluation runs the whole model).
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

from .errors import DataError, UsageError
from .model.gemm32 import float32_gemms
from .model.lm_head import next_token_nll, split_works
from .scales import sqnr_db

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


def _clone(out):
    if torch.is_tensor(out):
        return out.detach().clone()
    if isinstance(out, tuple):
        return tuple(_clone(o) for o in out)
    return out


def _nbytes(out) -> int:
    if torch.is_tensor(out):
        return out.numel() * out.element_size()
    return sum(_nbytes(o) for o in out) if isinstance(out, tuple) else 0


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
                size[0] += _nbytes(out)
                if size[0] <= REPLAY_CACHE_BYTES:
                    cache[j].append(_clone(out))
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
