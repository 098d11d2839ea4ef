"""Sequential (block-by-block) quantization: memory is a function of one block, not the model.

The model is built without weights (accelerate's ``init_empty_weights``: parameters on the meta
device) and planned whole (``build_plan``: ``--skip`` globs, first/last, routers and overrides
see full names); everything outside the repeated blocks (embeddings, final norm, head) is loaded
from the source safetensors (``fp8ptq.io.weights``: transformers' conversion mapping, so per-expert
MoE tensors become the fused experts), the calibration batches run once up to block 0
(``fp8ptq.model.block_inputs``), then for each block: load its tensors -> ``quantize_model`` on
that block alone with its part of the plan and the recorded inputs as its calibration batches (so
every calibrator, best-of, pow2-search, SmoothQuant, GPTQ, taps, fused experts, works per block
unchanged; under torchrun each rank runs its share and the statistics are reduced per block)
-> run the batches through the block for the next block's inputs (``propagate="quantized"``:
through the quantized block, the error propagates as at inference; ``"fp"``: the unquantized
outputs, which makes the result bit-identical to the in-memory pipeline) -> write the block
(``CheckpointWriter.add_block``) and free it (its tensors go to the meta device). GEMMs outside
the blocks (``--quantize-lm-head``) are quantized last, from the last block's outputs; then the
tensors outside the blocks are written and the checkpoint closed. Resident at once: the
outside modules, one block being quantized (two with ``propagate="fp"`` briefly holding its
float outputs), the writer's one open shard, and the activations up to their budget.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn

from ..algorithms.gptq.aim import Aim
from ..algorithms.gptq.sink import FirstTokenStream
from ..algorithms.gptq.sweep import host_factoring
from ..checkpoint.contents import plain_tensors
from ..checkpoint.layouts import choose_layout, describe_plan, model_type_of, quantized_modules
from ..checkpoint.writer import CheckpointWriter
from ..config.plan import SAMPLE_BATCHES, Planner, QuantPlan, build_plan
from ..config.recipe import Recipe
from ..errors import DataError, UsageError
from ..io.data import build_calibration_set, resolve_calib_spec
from ..io.loading import LoadedModel, load_tokenizer
from ..io.source import SafetensorsSource
from ..io.weights import WeightLoader, build_empty
from ..model.block_inputs import (
    ActivationStore,
    BlockBatch,
    capture_block_inputs,
    run_block,
    to_device,
)
from ..model.blocks import block_prefix, find_blocks, place
from ..nn.quant_gemm import simulated_gemms
from ..observe import distributed
from ..runtime.usage import release_free_memory
from .in_memory import QuantizeResult, high_precision_report, quantize_model, token_batches


class BlockLoader:
    """Loads checkpoint tensors (``fp8ptq.io.weights``: transformers' conversion mapping, so fused
    MoE experts are merged from their per-expert tensors) into a meta-built model and releases
    them; counts how many blocks hold float weights at once (``max_resident``)."""

    def __init__(self, model: nn.Module, source: SafetensorsSource, dtype: torch.dtype,
                 block_device: torch.device | str = "cpu"):
        self.model, self.source, self.dtype = model, source, dtype
        self.weights = WeightLoader(model, source, dtype)
        self.block_device = block_device  # where a block's tensors are read to
        self.resident: set[int] = set()
        self.max_resident = 0
        self.loads: list[int] = []  # block indices in load order (tests read it)

    def load_prefix(self, prefix: str, exclude: str | None = None, device=None) -> None:
        self.weights.load(self.weights.under(prefix, exclude), device)

    def load_block(self, index: int, prefix: str) -> None:
        self.load_prefix(prefix, device=self.block_device)
        self.resident.add(index)
        self.loads.append(index)
        self.max_resident = max(self.max_resident, len(self.resident))

    def release_block(self, index: int) -> None:
        self.resident.discard(index)


def quantize_sequential(folder: str | Path, recipe: Recipe, batches: list | None, *,
                        propagate: str = "quantized", activation_budget: int = 1 << 30,
                        spill_dir: str | Path | None = None, progress=None, open_writer=None,
                        planner: Planner | None = None, device: str = "cpu",
                        activations_on: str = "host", replay_budget: int = 1 << 30,
                        gpu_factor_limit: int | None = None):
    """Quantize the safetensors checkpoint in ``folder`` block by block; returns the
    ``QuantizeResult`` and the ``BlockLoader`` (for its residency counters).

    ``open_writer(model, plan)`` (called once the plan is made, before any block) returns a
    ``CheckpointWriter``: every quantized block is written to it and freed at once, the
    tensors outside the blocks are added last, and the caller closes it (``save_sequential``).
    Without it (or on a rank other than 0 under torchrun, which writes nothing) the quantized
    blocks stay in ``result.model``, or are freed when ``open_writer`` is given on another
    rank. Under torchrun every rank streams the same blocks, runs its share of the batches,
    and the statistics are reduced per block (inside ``quantize_model``). The process's
    allocator is left as the caller set it (``fp8ptq.runtime.usage.bound_heap``).
    ``planner``: the run's plan, asked for the (meta-device) model built here; made here for a
    call outside a run.

    ``device``: where each block is computed. On a GPU (``"cuda"``) only the block being
    quantized is there: its tensors are read from the safetensors files straight onto it,
    calibrated, quantized, run for the next block's inputs, written and dropped; the modules
    outside the blocks stay on the host (the embeddings run there once, for every batch, and
    the recorded keyword arguments move to the GPU once). ``activations_on``: ``"host"`` keeps
    the inter-block activations in host memory (moved to the GPU one batch at a time) up to
    ``activation_budget`` and on disk beyond; ``"device"`` keeps them on the GPU (the
    budget's choice when every batch fits there, ``fp8ptq.execution.budget``);
    ``replay_budget``: bytes of a block's partial-forward outputs sequential GPTQ may keep for
    replay (``fp8ptq.algorithms.gptq.replay``), on the block's device; ``gpu_factor_limit``:
    Hessians of more inputs are factored on the host (``sweep.host_factoring``)."""
    if propagate not in ("quantized", "fp"):
        raise UsageError(f"--propagate must be 'quantized' or 'fp', not {propagate!r}")
    if recipe.rotate is not None:  # the rotation spans embeddings, every block and lm_head
        raise UsageError("--rotate needs the whole model at once; use the in-memory pipeline "
                         "(not sequential mode)")
    dtype = getattr(torch, recipe.dtype)
    device = compute_device(device)
    model = build_empty(folder, dtype)
    found = find_blocks(model)
    if found is None:
        raise UsageError("sequential mode needs a model of repeated blocks (a ModuleList of "
                         "layers); this one has none")
    list_name, blocks = found
    loader = BlockLoader(model, SafetensorsSource(folder), dtype, device)
    loader.load_prefix("", exclude=f"{list_name}.")
    model.tie_weights()
    meta = [n for n, p in model.named_parameters()
            if p.is_meta and not n.startswith(f"{list_name}.")]
    if meta:
        raise DataError(f"{folder}: tensors missing from the checkpoint: {', '.join(meta[:5])}")

    # on the whole (meta) model: globs, first/last, routers
    plan = planner(model) if planner is not None else build_plan(model, recipe)
    outside = [m.name for m in plan.modules if not m.name.startswith(f"{list_name}.")]
    batches = list(batches or [])
    if not plan.modules:
        raise UsageError("no GEMM module left to quantize (check --skip / --override)")
    if not batches and plan.needs_calibration:
        raise UsageError("this recipe needs calibration data (--calib-data); dynamic per-token "
                         "activations (--act-granularity token) alone need none")
    writer = open_writer(model, plan) if open_writer and distributed.is_main() else None
    run = _Run(plan, progress, replay_budget)
    t0 = time.perf_counter()
    home = device if activations_on == "device" else "cpu"
    store = ActivationStore(activation_budget, spill_dir, home=home, compute=device)
    # under torchrun a rank carries its own share (+ the example batches every rank reads)
    kwargs_list = distributed.together(capture_block_inputs, model, blocks[0], batches, store,
                                       distributed.share_indices(len(batches), SAMPLE_BATCHES))
    kwargs_list = to_device(kwargs_list, device)  # masks, positions, rotary: once per batch
    aim = Aim.of(plan.recipe, plan.facts.causal_lm) if batches else None
    # sink-aware GPTQ aimed at the float model: the first tokens through each float block
    firsts = FirstTokenStream(model, blocks[0], batches, device) \
        if aim is not None and aim.anchored and plan.facts.gptq_in_order else None
    run.times["calibrate"] += time.perf_counter() - t0
    with host_factoring(gpu_factor_limit):
        store, tupled = _each_block(blocks, list_name, loader, store, kwargs_list, run,
                                    propagate, writer if open_writer is not None else None,
                                    open_writer is not None, device, firsts)
    if outside:
        run.quantize_outside(model, list_name, blocks, store, batches, tupled, device)
    store.close()
    if open_writer is not None:
        _agreed(writer, lambda w: _write_outside(w, model, list_name, run.reports))
    extras = run.extras
    extras["high_precision"] = high_precision_report(model)
    extras["sequential"] = {"blocks": len(blocks), "block_list": list_name,
                            "propagate": propagate, "max_resident_blocks": loader.max_resident,
                            "activation_budget": activation_budget, "device": str(device),
                            "activations_on": activations_on,
                            "outside_blocks": outside}
    result = QuantizeResult(model, run.reports, plan.skipped, run.stats, run.times,
                            run.warnings, extras, recipe=recipe, plan=plan)
    return result, loader


def _each_block(blocks, list_name: str, loader: BlockLoader, store: ActivationStore,
                kwargs_list: list, run: _Run, propagate: str, writer, writes: bool,
                device: torch.device, firsts: FirstTokenStream | None = None
                ) -> tuple[ActivationStore, bool]:
    """Each block in turn: loaded (onto ``device``), quantized, run for the next block's
    inputs, written (``writes``: rank 0's ``writer``) and freed. Returns the last block's
    outputs and whether blocks return tuples. ``firsts``: the float first-token stream, run
    through each block before it is quantized (``--gptq-sink-target float``)."""
    tupled = False
    for i, block in enumerate(blocks):
        prefix = block_prefix(list_name, i)
        # every step without a collective of its own ends all ranks together if one fails
        distributed.together(loader.load_block, i, prefix)
        nxt = store.like()
        if propagate == "fp":
            tupled = distributed.together(run_block, block, store, kwargs_list, nxt)
        anchors = None if firsts is None else firsts.through(block, {
            m.name[len(prefix):]: block.get_submodule(m.name[len(prefix):])
            for m in run.plan.gemms if m.name.startswith(prefix)})
        reports = run.quantize_block(block, prefix, store, kwargs_list, anchors)
        if propagate == "quantized":
            tupled = distributed.together(run_block, block, store, kwargs_list, nxt)
        store.close()
        store = nxt
        if writes:
            _agreed(writer, lambda w, b=block, p=prefix, r=reports: w.add_block(b, p, r))
            place(block, "meta")  # written (by rank 0): its tensors are freed
        elif device.type != "cpu":
            place(block, "cpu")  # kept in the result, not on the GPU beside the next block
        loader.release_block(i)
        release_free_memory()
    return store, tupled


def compute_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``"cuda"`` is the current GPU (``cuda:0`` where none is
    set), so that every tensor placed on it compares equal to the block's own."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        device = torch.device("cuda", index)
    return device


def _agreed(writer: CheckpointWriter | None, work) -> None:
    """``work(writer)`` where there is a writer (rank 0); a failure ends every rank together."""
    distributed.together(lambda: None if writer is None else work(writer))


def _write_outside(writer: CheckpointWriter, model: nn.Module, list_name: str,
                   reports: list) -> None:
    """The quantized GEMMs outside the blocks and every other tensor outside them (tied
    aliases once, as ``save_quantized``), the blocks themselves detached: they are written."""
    with _detached(model, list_name):
        quantized = [n for n, _ in quantized_modules(model)]
        if quantized:
            writer.add_modules(model, quantized, [r for r in reports if r.name in quantized])
        tie_targets = getattr(model, "all_tied_weights_keys", None) or {}
        writer.add_tensors(plain_tensors(model, set(quantized), tie_targets=tie_targets))


@contextmanager
def _detached(model: nn.Module, list_name: str):
    parent_name, _, attr = list_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    blocks = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList())
    try:
        yield
    finally:
        setattr(parent, attr, blocks)


class _Run:
    """Quantizes the blocks with the parts of the whole model's plan under them and adds their
    results up: reports, statistics, warnings and extras under full module names, and the
    stage times."""

    def __init__(self, plan: QuantPlan, progress, replay_budget: int = 1 << 30):
        self.plan, self.progress, self.replay_budget = plan, progress, replay_budget
        self.reports: list = []
        self.stats: dict = {}
        self.warnings: list[str] = []
        self.extras: dict = {"blocks": {}}
        self.times = {"calibrate": 0.0, "quantize": 0.0, "smoothquant": 0.0}

    def quantize_block(self, block: nn.Module, prefix: str, store: ActivationStore,
                       kwargs_list: list, first_tokens: dict | None = None) -> list:
        """``quantize_model`` on one block with its recorded inputs as calibration batches
        (read from the store when a forward needs them, so spilled ones stay on disk);
        ``first_tokens``: its GEMMs' float first-token inputs (``FirstTokenStream``)."""
        plan = self.plan.part(lambda n: n.startswith(prefix), prefix)
        if not plan.modules:
            return []
        block_batches = [None if kw is None else BlockBatch(store, j, kw)
                         for j, kw in enumerate(kwargs_list)] or None
        result = quantize_model(block, plan.recipe, block_batches, progress=self.progress,
                                plan=plan, activation_budget=self.replay_budget,
                                first_tokens=first_tokens)
        self._add(result, prefix)
        self.extras["blocks"][prefix.rstrip(".")] = {
            k: v for k, v in result.extras.items()
            if k not in ("high_precision", "experts", "taps", "fused_groups")}
        return result.modules

    def quantize_outside(self, model: nn.Module, list_name: str, blocks: nn.ModuleList,
                         store: ActivationStore, batches: list, tupled: bool,
                         device: str = "cpu") -> None:
        """GEMMs outside the blocks (``--quantize-lm-head``: the head; OPT's projections): the
        whole model runs with every block replaced by a stand-in that hands on the last
        block's stored output for the running batch, so each of those GEMMs sees the input it
        sees at inference, and ``quantize_model`` quantizes them as in memory (on ``device``:
        the modules outside the blocks move there for it, the blocks are all written)."""
        parent_name, _, attr = list_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if torch.device(device).type != "cpu":
            batches = to_device(batches, device)
        feed = _Feed(store, batches)
        setattr(parent, attr, nn.ModuleList(_Stand(feed, k == 0, tupled)
                                            for k in range(len(blocks))))
        if torch.device(device).type != "cpu":
            place(model, device)  # the blocks are stand-ins now: the outside modules alone
        handle = model.register_forward_pre_hook(feed.hook, with_kwargs=True)
        plan = self.plan.part(lambda n: not n.startswith(f"{list_name}."))
        try:
            result = quantize_model(model, plan.recipe, [b if i in store.items else None
                                                         for i, b in enumerate(batches)] or None,
                                    progress=self.progress, plan=plan)
        finally:
            handle.remove()
            setattr(parent, attr, blocks)
        self._add(result, "")

    def _add(self, result: QuantizeResult, prefix: str) -> None:
        for r in result.modules:
            r.name = prefix + r.name
            self.reports.append(r)
        self.stats.update({prefix + k: v for k, v in result.stats.items()})
        self.warnings += [prefix + w for w in result.warnings]
        for key in ("experts", "taps"):
            if result.extras.get(key):
                self.extras.setdefault(key, {}).update(
                    {prefix + n: e for n, e in result.extras[key].items()})
        for group in result.extras.get("fused_groups") or []:
            self.extras.setdefault("fused_groups", []).append(
                {**group, "modules": [prefix + m for m in group["modules"]]})
        for k, v in result.seconds.items():
            self.times[k] = self.times.get(k, 0.0) + v


class _Feed:
    """The running batch's last-block output, found from the ``input_ids`` tensor the model is
    called with (each batch dict holds its own)."""

    def __init__(self, store: ActivationStore, batches: list):
        self.store = store
        self.index = {id(b["input_ids"]): i for i, b in enumerate(batches)
                      if isinstance(b, Mapping) and "input_ids" in b}
        self.current = None

    def hook(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if id(ids) not in self.index:  # e.g. SmoothQuant's one-row example batch
            raise UsageError("sequential mode quantizes GEMMs outside the blocks from the "
                             "calibration batches themselves; this stage runs other inputs "
                             "(drop --smoothquant, or use the in-memory pipeline)")
        self.current = self.store.get(self.index[id(ids)])


class _Stand(nn.Module):
    """A block's stand-in in ``quantize_outside``: the first returns the stored output of the
    last block, the others pass it on."""

    def __init__(self, feed: _Feed, first: bool, tupled: bool):
        super().__init__()
        self.feed, self.first, self.tupled = feed, first, tupled

    def forward(self, *args, **kwargs):
        h = self.feed.current if self.first else (args[0] if args else kwargs["hidden_states"])
        return (h,) if self.tupled else h


def write_sequential(folder: str | Path, recipe: Recipe, batches: list | None, output, *,
                     force: bool = False, tokenizer=None, close_kwargs=None,
                     max_shard_bytes: int | None = None, **options):
    """``quantize_sequential`` writing checkpoint ``output`` as it goes: each block is written
    (``CheckpointWriter.add_block``) as soon as it is quantized and then freed; the writer is
    closed at the end with ``close_kwargs(result)`` (source, calibration facts, ``check``...)
    passed to ``CheckpointWriter.close``. Rank 0 writes under torchrun. Returns (result,
    sizes: what ``close`` returns, {} on other ranks). Any failure leaves nothing at
    ``output``. ``max_shard_bytes``: the output shard size (default 2 GiB); the writer holds
    the open shard in memory, so it is part of the peak (``route.shard_bytes`` sizes it under
    ``--max-memory``). ``options``: those of ``quantize_sequential``."""
    writers: list[CheckpointWriter] = []
    sizes: dict = {}
    with ExitStack() as stack:
        def open_writer(model, plan):
            choice = choose_layout(describe_plan(plan), model_type=model_type_of(model))
            writers.append(stack.enter_context(CheckpointWriter.open(
                output, choice, force=force, max_shard_bytes=max_shard_bytes)))
            return writers[-1]

        result, _ = quantize_sequential(folder, recipe, batches, open_writer=open_writer,
                                        **options)
        writer = writers[0] if writers else None
        if writer is not None and writer.choice.warning:
            result.warnings.append(writer.choice.warning)

        def close(w):
            sizes.update(w.close(result.model, recipe, result=result, tokenizer=tokenizer,
                                 **(close_kwargs(result) if close_kwargs else {})))

        _agreed(writer, close)
    return result, sizes


def calibration_from_folder(folder: str | Path, recipe: Recipe, texts):
    """(tokenizer, calibration windows, token batches) for the safetensors checkpoint in
    ``folder`` without loading its weights: the streamed paths' data (None, None for
    ``texts`` None)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--sequential reads a local safetensors folder; {folder} is not one")
    tokenizer = load_tokenizer(str(folder), folder)
    if texts is None:
        return tokenizer, None, None
    calib = build_calibration_set(texts, tokenizer, num_samples=recipe.num_samples,
                                  seq_len=recipe.seq_len, seed=recipe.seed,
                                  source=resolve_calib_spec(recipe.calib_data),
                                  windows=recipe.calib_windows,
                                  start=recipe.calib_prefix_token)
    return tokenizer, calib, list(token_batches(calib.input_ids, recipe.batch_size))


def quantize_folder(folder: str | Path, recipe: Recipe, texts, *, propagate: str = "quantized",
                    activation_budget: int = 1 << 30, spill_dir=None, progress=None,
                    output=None, force: bool = False, close_kwargs=None,
                    max_shard_bytes: int | None = None, planner: Planner | None = None,
                    device: str = "cpu", activations_on: str = "host",
                    replay_budget: int = 1 << 30, gpu_factor_limit: int | None = None):
    """The CLI's ``--sequential``: tokenizer and calibration windows from ``folder``, then
    ``write_sequential`` to ``output`` (``close_kwargs(result, calib)``), or, without
    ``output``, ``quantize_sequential`` keeping the quantized model. Returns (result,
    LoadedModel stand-in, calib, sizes). ``planner``: the run's plan (``quantize_sequential``)."""
    folder = Path(folder)
    tokenizer, calib, batches = calibration_from_folder(folder, recipe, texts)
    options = dict(propagate=propagate, activation_budget=activation_budget,
                   spill_dir=spill_dir, progress=progress, planner=planner, device=device,
                   activations_on=activations_on, replay_budget=replay_budget,
                   gpu_factor_limit=gpu_factor_limit)
    with simulated_gemms():  # quantized blocks feed the next one as ``quantize_model``'s do
        if output is None:
            (result, _), sizes = quantize_sequential(folder, recipe, batches, **options), {}
        else:
            result, sizes = write_sequential(
                folder, recipe, batches, output, force=force, tokenizer=tokenizer,
                close_kwargs=close_kwargs and (lambda r: close_kwargs(r, calib)),
                max_shard_bytes=max_shard_bytes, **options)
    loaded = LoadedModel(result.model, tokenizer, str(folder), "local", str(folder))
    return result, loaded, calib, sizes
