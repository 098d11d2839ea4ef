"""Activations between blocks in sequential mode: captured at block 0, carried block to block.

``capture_block_inputs`` runs the calibration batches through the model up to the first block
(a forward pre-hook records the block's inputs and stops the forward there), so the embeddings
run once for all batches. ``run_block`` carries them through one block. Under torchrun a rank
handles only the batches it calibrates on (``indices``). ``ActivationStore`` keeps them in memory
up to a byte budget and spills the rest to files in a scratch folder (read back when needed).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..model.forward import micro_batch_spans
from ..model.gemm32 import float32_gemms
from ..model.lean import lean_forwards


class ActivationStore:
    """Tensors by index, in memory up to ``budget_bytes`` then in memory-mapped files under
    ``spill_dir``. ``spilled`` counts what went to disk (tests assert it).

    ``home``: where the kept tensors live (None: where they were made); ``compute``: where
    ``get`` hands them out (None: where they live). The one-block GPU path keeps them on the
    host (``home="cpu"``, page-locked where CUDA is real, so each batch's copy to the GPU
    is a DMA) or, when its GPU budget has room for every batch, on the GPU itself."""

    def __init__(self, budget_bytes: int, spill_dir: str | Path | None = None, *,
                 home: torch.device | str | None = None,
                 compute: torch.device | str | None = None):
        self.budget = budget_bytes
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.home = None if home is None else torch.device(home)
        self.compute = None if compute is None else torch.device(compute)
        self.items: dict[int, object] = {}
        self.resident_bytes = 0
        self.spilled = 0
        self._tmp = None

    def like(self) -> ActivationStore:
        """An empty store with the same budget, folder and devices (the next block's)."""
        return ActivationStore(self.budget, self.spill_dir, home=self.home,
                               compute=self.compute)

    def put(self, index: int, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        if self.resident_bytes + n <= self.budget:
            self.items[index] = self._kept(t)
            self.resident_bytes += n
            return
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fp8ptq-act-", dir=self.spill_dir)
        path = Path(self._tmp.name) / f"{index}.bin"
        t = t.cpu()
        raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        raw.reshape(-1).numpy().tofile(path)
        self.items[index] = (path, t.dtype, tuple(t.shape))
        self.spilled += 1

    def _kept(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` on ``home`` that the caller's later writes cannot reach."""
        home = self.home or t.device
        if home.type == "cpu" and t.device.type == "cuda" and torch.cuda.is_available():
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t)
        return t.to(home, copy=True)

    def get(self, index: int) -> torch.Tensor:
        item = self.items[index]
        if isinstance(item, torch.Tensor):
            return self._handed(item)
        path, dtype, shape = item
        raw = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r").copy())
        return self._handed(raw.view(dtype).reshape(shape))

    def _handed(self, t: torch.Tensor) -> torch.Tensor:
        if self.compute is None or t.device == self.compute:
            return t
        return t.to(self.compute, non_blocking=t.is_pinned())

    def __len__(self):
        return len(self.items)

    def close(self) -> None:
        self.items.clear()
        self.resident_bytes = 0
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def to_device(value, device: torch.device | str):
    """``value`` (a batch's recorded keyword arguments: tensors, tuples of tensors such as
    rotary ``(cos, sin)``, plain values) with every tensor moved to ``device``."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


class _Stop(Exception):
    pass


def capture_block_inputs(model: nn.Module, block: nn.Module, batches: list,
                         store: ActivationStore, indices: Iterable[int] | None = None
                         ) -> list[dict | None]:
    """Run the batches (those in ``indices``; default all) up to ``block``; the hidden states
    go to ``store``, the other keyword arguments (masks, positions, rotary embeddings) are
    returned per batch (None for a batch not run)."""
    kwargs_list: list[dict | None] = [None] * len(batches)
    current = [0]

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        store.put(current[0], hidden)
        kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value",
                                                            "layer_past", "cache_position")}
        kw["use_cache"] = False
        kwargs_list[current[0]] = kw
        raise _Stop

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode(), float32_gemms(model=model):
            for i in (range(len(batches)) if indices is None else sorted(indices)):
                current[0], batch = i, batches[i]
                try:
                    model(**batch, use_cache=False) if isinstance(batch, dict) else model(batch)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return kwargs_list


def run_block(block: nn.Module, store: ActivationStore, kwargs_list: list[dict | None],
              out: ActivationStore, replay=None) -> bool:
    """Every captured batch through ``block`` into ``out``, in the statistics pass's
    micro-batches of about ``MICRO_TOKENS`` tokens (``fp8ptq.model.forward.micro_batch_spans``:
    the block's intermediate activations are those of one piece, its outputs the whole
    batch's bit for bit); True when the block returns a tuple (transformers' older layer
    convention), which stand-ins must mimic. ``replay``: sequential GPTQ's records
    (``fp8ptq.algorithms.gptq.replay.PartialForwards``) of submodule outputs still valid for this
    forward; a
    batch with records runs whole (they are the whole batch's) with them replayed."""
    tupled = False
    with torch.inference_mode(), float32_gemms(model=block), lean_forwards(block):
        for i, kw in enumerate(kwargs_list):
            if kw is None:
                continue
            hidden = store.get(i)
            result = None
            batch = {"hidden_states": hidden, **kw}
            replayed = replay is not None and i in replay.kept
            spans = [(0, batch)] if replayed else micro_batch_spans(batch)
            with replay.replaying(i) if replayed else nullcontext():
                for start, piece in spans:
                    y = block(**piece)
                    tupled = isinstance(y, tuple)
                    h = y[0] if tupled else y
                    if len(spans) == 1:
                        result = h
                        break
                    if result is None:  # the pieces' outputs written into one batch tensor
                        result = h.new_empty((hidden.shape[0], *h.shape[1:]))
                    result[start:start + h.shape[0]] = h
            del hidden, spans, batch
            out.put(i, result)
            del result
    return tupled


class BlockBatch(Mapping):
    """One block's calibration batch (sequential mode, sequential GPTQ): the recorded keyword
    arguments, and its hidden states read from the activation store only while a forward
    runs."""

    def __init__(self, store: ActivationStore, index: int, kwargs: dict):
        self.store, self.index, self.kwargs = store, index, kwargs

    def __getitem__(self, key):
        return self.store.get(self.index) if key == "hidden_states" else self.kwargs[key]

    def __iter__(self):
        return iter(("hidden_states", *self.kwargs))

    def __len__(self):
        return 1 + len(self.kwargs)
