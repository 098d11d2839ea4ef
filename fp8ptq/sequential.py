"""Sequential (block-by-block) quantization: memory is a function of one block, not the model.

The model is built without weights (accelerate's ``init_empty_weights``: parameters on the meta
device); everything outside the repeated blocks (embeddings, final norm, head) is loaded from the
source safetensors, the calibration batches run once up to block 0 (a pre-hook records its
inputs and stops the forward), then for each block: load its tensors -> run ``quantize_model`` on
that block alone with the recorded inputs as its calibration batches (so every calibrator,
best-of, pow2-search, SmoothQuant, GPTQ, taps, works per block unchanged) -> run the batches
through the block for the next block's inputs (``propagate="quantized"``: through the quantized
block, the error propagates as at inference; ``"fp"``: the unquantized outputs, which makes the
result bit-identical to the in-memory pipeline) -> release the block's float weights.

Inter-block activations live in an ``ActivationStore``: in memory up to a byte budget, spilled
to memory-mapped files beyond it (in the output's temporary folder).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from .data import build_calibration_set, resolve_calib_spec
from .errors import DataError, UsageError
from .loading import LoadedModel, load_tokenizer
from .model.blocks import block_prefix, find_blocks
from .model.experts import find_experts
from .pipeline import (
    QuantizeResult,
    high_precision_report,
    plan_targets,
    quantize_model,
    token_batches,
)
from .recipe import Recipe
from .source import SafetensorsSource, build_empty  # noqa: F401 - re-exported


class ActivationStore:
    """Tensors by index, in memory up to ``budget_bytes`` then in memory-mapped files under
    ``spill_dir``. ``spilled`` counts what went to disk (tests assert it)."""

    def __init__(self, budget_bytes: int, spill_dir: str | Path | None = None):
        self.budget = budget_bytes
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.items: dict[int, object] = {}
        self.resident_bytes = 0
        self.spilled = 0
        self._tmp = None

    def put(self, index: int, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        if self.resident_bytes + n <= self.budget:
            self.items[index] = t.clone()
            self.resident_bytes += n
            return
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fp8ptq-act-", dir=self.spill_dir)
        path = Path(self._tmp.name) / f"{index}.bin"
        raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        raw.reshape(-1).numpy().tofile(path)
        self.items[index] = (path, t.dtype, tuple(t.shape))
        self.spilled += 1

    def get(self, index: int) -> torch.Tensor:
        item = self.items[index]
        if isinstance(item, torch.Tensor):
            return item
        path, dtype, shape = item
        raw = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r").copy())
        return raw.view(dtype).reshape(shape)

    def __len__(self):
        return len(self.items)

    def close(self) -> None:
        self.items.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class BlockLoader:
    """Loads model tensors from a ``SafetensorsSource`` into a meta-built model and releases
    them; counts how many blocks hold float weights at once (``max_resident``)."""

    def __init__(self, model: nn.Module, source: SafetensorsSource, dtype: torch.dtype):
        self.model, self.source, self.dtype = model, source, dtype
        self.resident: set[int] = set()
        self.max_resident = 0
        self.bytes_read = 0

    def load_prefix(self, prefix: str, exclude: str | None = None) -> None:
        names = [n for n in self.source.names() if n.startswith(prefix)
                 and not (exclude and n.startswith(exclude))]
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        for name, t in self.source.read([n for n in names if n in params or n in buffers]).items():
            t = t.to(self.dtype) if t.is_floating_point() else t
            self.bytes_read += t.numel() * t.element_size()
            set_module_tensor_to_device(self.model, name, "cpu", value=t)

    def load_block(self, index: int, prefix: str) -> None:
        self.load_prefix(prefix)
        self.resident.add(index)
        self.max_resident = max(self.max_resident, len(self.resident))

    def release_block(self, index: int) -> None:
        self.resident.discard(index)


class _Stop(Exception):
    pass


def capture_block_inputs(model: nn.Module, block: nn.Module, batches: list,
                         store: ActivationStore) -> list[dict]:
    """Run every batch up to ``block``; the hidden states go to ``store``, the other keyword
    arguments (masks, positions, rotary embeddings) are returned per batch."""
    kwargs_list: list[dict] = []

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        store.put(len(kwargs_list), hidden)
        kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value",
                                                            "layer_past", "cache_position")}
        kw["use_cache"] = False
        kwargs_list.append(kw)
        raise _Stop

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            for batch in batches:
                try:
                    model(**batch, use_cache=False) if isinstance(batch, dict) else model(batch)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return kwargs_list


def _run_block(block: nn.Module, store: ActivationStore, kwargs_list: list[dict],
               out: ActivationStore) -> None:
    with torch.inference_mode():
        for i, kw in enumerate(kwargs_list):
            y = block(store.get(i), **kw)
            out.put(i, y[0] if isinstance(y, tuple) else y)


def quantize_sequential(folder: str | Path, recipe: Recipe, batches: list | None, *,
                        propagate: str = "quantized", activation_budget: int = 1 << 30,
                        spill_dir: str | Path | None = None, progress=None):
    """Quantize the safetensors checkpoint in ``folder`` block by block; returns the
    ``QuantizeResult`` (the model holds the quantized blocks) and the ``BlockLoader`` (for its
    residency counters)."""
    if propagate not in ("quantized", "fp"):
        raise UsageError(f"--propagate must be 'quantized' or 'fp', not {propagate!r}")
    if recipe.rotate is not None:  # the rotation spans embeddings, every block and lm_head
        raise UsageError("--rotate needs the whole model at once; use the in-memory pipeline "
                         "(not sequential mode)")
    dtype = getattr(torch, recipe.dtype)
    model = build_empty(folder, dtype)
    found = find_blocks(model)
    if found is None:
        raise UsageError("sequential mode needs a model of repeated blocks (a ModuleList of "
                         "layers); this one has none")
    list_name, blocks = found
    fused = [name for name, _, _ in find_experts(model)]
    if fused:  # transformers saves them per expert; the block loader reads fused names only
        raise UsageError(f"sequential mode cannot load fused MoE experts yet ({fused[0]}); "
                         "use the in-memory pipeline (drop --sequential)")
    source = SafetensorsSource(folder)
    loader = BlockLoader(model, source, dtype)
    loader.load_prefix("", exclude=f"{list_name}.")
    model.tie_weights()
    meta = [n for n, p in model.named_parameters()
            if p.is_meta and not n.startswith(f"{list_name}.")]
    if meta:
        raise DataError(f"{folder}: tensors missing from the checkpoint: {', '.join(meta[:5])}")

    targets, skipped = plan_targets(model, recipe)
    outside = [t.name for t in targets if not t.name.startswith(f"{list_name}.")]
    if outside:
        raise UsageError(f"sequential mode quantizes GEMMs inside the repeated blocks; "
                         f"{', '.join(outside)} is outside them (drop --quantize-lm-head or "
                         "use the in-memory pipeline)")
    times = {"calibrate": 0.0, "quantize": 0.0, "smoothquant": 0.0}
    t0 = time.perf_counter()
    store = ActivationStore(activation_budget, spill_dir)
    kwargs_list = capture_block_inputs(model, blocks[0], batches or [], store)
    times["calibrate"] += time.perf_counter() - t0

    reports, stats, warnings, extras = [], {}, [], {"blocks": {}}
    for i, block in enumerate(blocks):
        prefix = block_prefix(list_name, i)
        loader.load_block(i, prefix)
        t0 = time.perf_counter()
        local_skip = [n[len(prefix):] for n in skipped if n.startswith(prefix)]
        block_recipe = recipe.merged(keep_first_last=False, quantize_lm_head=True,
                                     skip=list(recipe.skip) + local_skip)
        if not block_recipe.skip:
            block_recipe.skip = []
        nxt = ActivationStore(activation_budget, spill_dir)
        if propagate == "fp" and kwargs_list:
            _run_block(block, store, kwargs_list, nxt)
        block_batches = [{"hidden_states": store.get(j), **kw} for j, kw in enumerate(kwargs_list)]
        has_targets = bool(plan_targets(block, block_recipe)[0])
        if has_targets:
            result = quantize_model(block, block_recipe, block_batches or None, progress=progress)
            for r in result.modules:
                r.name = prefix + r.name
                reports.append(r)
            stats.update({prefix + k: v for k, v in result.stats.items()})
            warnings += [prefix + w for w in result.warnings]
            extras["blocks"][str(i)] = {k: v for k, v in result.extras.items()
                                        if k != "high_precision"}
            for k, v in result.seconds.items():
                times[k] = times.get(k, 0.0) + v
        del block_batches
        if propagate == "quantized" and kwargs_list:
            _run_block(block, store, kwargs_list, nxt)
        store.close()
        store = nxt
        loader.release_block(i)
        times["calibrate"] += 0.0 * (time.perf_counter() - t0)
    store.close()
    extras["high_precision"] = high_precision_report(model)
    extras["sequential"] = {"blocks": len(blocks), "block_list": list_name,
                            "propagate": propagate, "max_resident_blocks": loader.max_resident,
                            "activation_budget": activation_budget}
    return QuantizeResult(model, reports, skipped, stats, times, warnings, extras), loader


def quantize_folder(folder: str | Path, recipe: Recipe, texts, *, propagate: str = "quantized",
                    activation_budget: int = 1 << 30, spill_dir=None, progress=None):
    """The CLI's ``--sequential``: tokenizer and calibration windows from ``folder``, then
    ``quantize_sequential``. Returns (result, LoadedModel stand-in for the writer, calib)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--sequential reads a local safetensors folder; {folder} is not one")
    tokenizer = load_tokenizer(str(folder), folder)
    calib = None
    if texts is not None:
        calib = build_calibration_set(texts, tokenizer, num_samples=recipe.num_samples,
                                      seq_len=recipe.seq_len, seed=recipe.seed,
                                      source=resolve_calib_spec(recipe.calib_data))
    batches = list(token_batches(calib.input_ids, recipe.batch_size)) if calib else None
    result, _ = quantize_sequential(folder, recipe, batches, propagate=propagate,
                                    activation_budget=activation_budget, spill_dir=spill_dir,
                                    progress=progress)
    loaded = LoadedModel(result.model, tokenizer, str(folder), "local", str(folder))
    return result, loaded, calib
