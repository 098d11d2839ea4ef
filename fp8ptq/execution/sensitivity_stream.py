"""``--metric sqnr`` block by block: the analysis of a model that does not fit in memory.

The SQNR metric needs no model pass per unit: each GEMM's output SQNR on sampled calibration
rows, per format, from the statistics of one calibration pass. So it streams like sequential
quantization (``fp8ptq.execution.streaming``, the same loader and activation store): the model is
built without weights and planned whole (``--skip`` globs, first / last layers, overrides see full
names), the calibration batches run once up to block 0, then per block: load its tensors ->
the same ``Session`` the in-memory analysis runs, on that block alone with its recorded inputs
and its part of each format's plan -> carry the batches through the unquantized block (the
in-memory analysis measures each unit alone in an otherwise unquantized model, so the inputs
of every block are the float model's) -> free the block. At most two blocks are resident
(one, and the next while loading). The module statistics and every unit's measure equal the
in-memory ``analyze(metric="sqnr", verify=False)``'s (tested).

What cannot stream: ``--metric ppl`` (a perplexity pass of the whole model per unit) and the
check runs (the whole model with every unit / the suggestion quantized); GEMMs outside the
blocks (``--quantize-lm-head``). Each is refused with the reason.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from ..config.recipe import Recipe
from ..errors import UsageError
from ..io.source import SafetensorsSource
from ..io.weights import build_empty
from ..model.block_inputs import ActivationStore, BlockBatch, capture_block_inputs, run_block
from ..model.blocks import block_prefix, find_blocks
from ..runtime.usage import release_free_memory
from ..sensitivity.report import SensitivityResult, UnitResult
from ..sensitivity.run import (
    SQNR_NOTE,
    Session,
    check_request,
    rank,
    suggest_for,
    unit_measure,
    with_module_warnings,
)
from ..sensitivity.swap import plan_format
from ..sensitivity.units import group_units
from .streaming import BlockLoader


def analyze_streamed(folder: str | Path, recipe: Recipe, batches: list, *,
                     formats=("e4m3",), stat_formats=(), level: str = "module",
                     target: str = "1%", activation_budget: int = 1 << 30,
                     spill_dir: str | Path | None = None, progress=None
                     ) -> tuple[SensitivityResult, int]:
    """``analyze(metric="sqnr", verify=False)`` of the safetensors checkpoint in ``folder``,
    one block resident at a time; returns the result and the most blocks resident at once."""
    if not batches:
        raise UsageError("sensitivity needs calibration data")
    formats, stat_formats = check_request(recipe, target, formats, stat_formats)
    primary = formats[0]
    t_start = time.perf_counter()
    dtype = getattr(torch, recipe.dtype)
    model = build_empty(folder, dtype)
    found = find_blocks(model)
    if found is None:
        raise UsageError("a streamed analysis needs a model of repeated blocks; this one has none")
    list_name, blocks = found
    loader = BlockLoader(model, SafetensorsSource(folder), dtype)
    loader.load_prefix("", exclude=f"{list_name}.")
    model.tie_weights()
    plans = {fmt: plan_format(model, recipe, fmt) for fmt in stat_formats}  # once, whole
    targets = plans[primary].gemms
    outside = [t.name for t in targets if not t.name.startswith(f"{list_name}.")]
    if outside or plans[primary].experts:
        raise UsageError(f"a streamed analysis measures the GEMMs inside the repeated blocks "
                         f"({(outside or [plans[primary].experts[0].name])[0]} is not one); "
                         "drop --quantize-lm-head, or analyze in memory")
    if not targets:
        raise UsageError("no GEMM module left to analyze (check --skip / --override)")
    units = group_units(model, [t.name for t in targets], level)
    unit_of = {n: u.name for u in units for n in u.modules}
    store = ActivationStore(activation_budget, spill_dir)
    kwargs_list = capture_block_inputs(model, blocks[0], batches, store)
    modules = {}
    for i, block in enumerate(blocks):
        prefix = block_prefix(list_name, i)
        loader.load_block(i, prefix)
        local = [replace(t, name=t.name[len(prefix):]) for t in targets
                 if t.name.startswith(prefix)]
        if local:
            block_batches = [BlockBatch(store, j, kw) for j, kw in enumerate(kwargs_list)
                             if kw is not None]
            session = Session(block, recipe, block_batches, local, "module", progress)
            for fmt in stat_formats:
                session.plan(fmt, part=plans[fmt].part(lambda n, p=prefix: n.startswith(p),
                                                       prefix))
                session.sweep(fmt, None, None, None)
            for name, stats in session.modules.items():
                modules[prefix + name] = replace(stats, name=prefix + name,
                                                 unit=unit_of[prefix + name])
        nxt = ActivationStore(activation_budget, spill_dir)
        run_block(block, store, kwargs_list, nxt)  # the float block: units are measured alone
        store.close()
        store = nxt
        block.to("meta")
        loader.release_block(i)
        release_free_memory()
    store.close()
    results = []
    for u in units:
        r = UnitResult(u.name, u.modules, u.pattern, u.layer)
        for fmt in formats:
            r.results[fmt] = unit_measure("sqnr", None, None,
                                      [modules[n].formats[fmt] for n in u.modules])
        results.append(r)
    ranked = rank(results, primary)
    suggestion = suggest_for(ranked, primary, target, "sqnr", None)
    ordered = [modules[t.name] for t in targets]
    times = {"total": time.perf_counter() - t_start}
    warnings = ["streamed block by block: the check runs (every unit / the suggestion "
                "applied) need the whole model and were not run"]
    return (SensitivityResult(level, "sqnr", SQNR_NOTE, formats, stat_formats, None, ranked,
                              ordered, suggestion, {}, {}, times,
                              with_module_warnings(warnings, ordered)), loader.max_resident)


__all__ = ["analyze_streamed"]
