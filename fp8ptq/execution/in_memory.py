"""The quantize pipeline: one calibration pass -> scales -> ``QuantGemm`` modules -> report."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ..algorithms.bn_retune import retune_batchnorm
from ..algorithms.gptq.aim import Aim
from ..algorithms.gptq.sequential import outside_blocks, quantize_in_order
from ..algorithms.rotation import rotate_model
from ..algorithms.smoothquant.norms import apply_smoothquant
from ..calibrators.layerwise import choose_layerwise
from ..calibrators.registry import weight_entry
from ..config.plan import (  # noqa: F401
    SAMPLE_BATCHES,
    ModulePlan,
    QuantPlan,
    build_plan,
    hessian_diagonal_only,
    plan_experts,
    plan_gemms,
    reads_data,
    run_facts,
)
from ..config.recipe import Recipe
from ..errors import UsageError
from ..io.placement import materialize_offloaded
from ..model.forward import (  # noqa: F401 - run_batch, token_batches re-exported
    head_observed,
    micro_batches,
    run_batch,
    token_batches,
)
from ..model.gemm32 import float32_gemms
from ..nn.fused import (
    fused_groups,
    unified_weight_scales,
    unify_fused,
    unify_input_scales,
)
from ..nn.quant_experts import (
    ExpertObserver,
    QuantExperts,
)
from ..nn.quant_gemm import QuantGemm, simulated_gemms
from ..observe import distributed
from ..observe.hessian import HessianCollector
from ..observe.observers import TensorStats
from ..steps.calibrate import collect_stats, plan_targets  # noqa: F401 - plan_targets re-exported
from ..steps.quantize_module import (  # noqa: F401 - ExpertsTarget re-exported
    ExpertsTarget,
    ModuleReport,
    Target,
    quantize_experts_module,
    quantize_target,
    target_granularity,
)
from ..taps.taps import ActivationTaps
from .experts_quant import sweep_experts


@dataclass
class QuantizeResult:
    model: nn.Module
    modules: list[ModuleReport]
    skipped: list[str]
    stats: dict[str, TensorStats]
    seconds: dict[str, float]
    warnings: list[str]
    extras: dict = field(default_factory=dict)  # reports of optional stages, by stage name
    recipe: Recipe | None = None  # the recipe this result was quantized with
    plan: QuantPlan | None = None  # what every module got (``fp8ptq.config.plan``)


def calibration_passes(recipe: Recipe) -> int:
    """How many times the calibration batches go through the model (for progress bars)."""
    return run_facts(recipe).passes


def quantize_model(model: nn.Module, recipe: Recipe, batches: Iterable | None = None,
                   progress=None, plan: QuantPlan | None = None,
                   activation_budget: int = 1 << 30,
                   first_tokens: dict | None = None) -> QuantizeResult:
    """Quantize ``model`` in place per ``recipe``; ``batches`` feed the calibration pass (not
    needed for weight-only or dynamic per-token activations). ``plan``: the run's plan of
    ``model`` (``build_plan(model, recipe)``, made by the run's entry point and used as it is,
    through the transform stages); made here for a call outside a run. Every forward of every
    stage runs bf16 / fp16 GEMMs in float32 on CPUs without a fast kernel for them
    (``fp8ptq.model.gemm32``), and every quantized GEMM that feeds a later stage (sequential
    GPTQ's groups) is simulated on every device (``simulated_gemms``): the same arithmetic on
    a CPU and a GPU, and no compiling of the real FP8 kernel's activation quantizer, which is
    inference's (``torch.compile``, seconds per process) for forwards a GPU runs in
    milliseconds either way. The process's allocator is left as the caller set it (the
    ``fp8ptq`` command bounds the heap: ``fp8ptq.runtime.usage.bound_heap``).
    ``activation_budget``: bytes sequential GPTQ may keep of activations (the inter-block
    store, the partial forwards' replayed outputs) where the model's tensors live; the
    one-block GPU path sizes it from the GPU budget. ``first_tokens``: the float model's
    first-token inputs of ``model``'s GEMMs (``--gptq-sink-target float`` on a block streamed
    on its own: ``fp8ptq.algorithms.gptq.sink.FirstTokenStream``)."""
    with float32_gemms(model=model), simulated_gemms():
        return _quantize_model(model, recipe, batches, progress, plan, activation_budget,
                               first_tokens)


@dataclass
class StageRun:
    """What a transform stage reads and changes: the model (in place), the recipe and plan
    (a stage that changes the modules re-binds the plan it was given, ``QuantPlan.rebind``),
    the calibration batches and the run's extras (its report entry goes there by name)."""

    model: nn.Module
    recipe: Recipe
    plan: QuantPlan | None
    batches: list | None
    progress: object
    extras: dict


@dataclass(frozen=True)
class Stage:
    """One optional transform of the in-memory run, registered in ``STAGES``: ``at`` says when
    it runs ("model": before a plan is built, since it may change the modules, e.g. untying
    lm_head, and a plan the run was given is re-bound, not dropped; "weights": after planning,
    before the statistics pass; "after": once every module is quantized); ``applies(recipe)``
    whether the recipe asks for it; ``needs_data`` whether it reads calibration batches;
    ``run`` returns its report entry (``extras[name]``)."""

    name: str
    at: str
    applies: Callable[[Recipe], bool]
    run: Callable[[StageRun], object]
    needs_data: bool = False


def _rotation(run: StageRun):
    materialize_offloaded(run.model)
    info = rotate_model(run.model, run.recipe.rotate, seed=run.recipe.seed)
    if run.plan is not None:  # it decides by name: kept, its entries re-bound to the modules
        run.plan.rebind(run.model)  # as they are now (lm_head untied: its own weight)
    return info


def _smoothquant(run: StageRun):
    materialize_offloaded(run.model)  # SmoothQuant folds its factors into the weights
    search = run.recipe.smoothquant == "auto"
    pre = collect_stats(run.model, run.plan.gemms, run.batches, run.progress,
                        sample_batches=SAMPLE_BATCHES if search else 0)
    return apply_smoothquant(run.model, run.plan.gemms, pre.stats,
                             pre.row_samples() if search else {}, run.plan,
                             example=run.batches[0])


def _bn_retune(run: StageRun):
    return retune_batchnorm(run.model, run.batches, run.progress)


# The optional transforms, in the order they run within their ``at``. A new transform is its
# algorithm (fp8ptq/algorithms/) plus one line here; the statistics pass, the calibrators and
# GPTQ between "weights" and "after" are the run's core.
STAGES: tuple[Stage, ...] = (
    Stage("rotation", "model", lambda r: r.rotate is not None, _rotation),
    Stage("smoothquant", "weights", lambda r: run_facts(r).smoothquant, _smoothquant,
          needs_data=True),
    Stage("bn_retune", "after", lambda r: run_facts(r).bn_retune, _bn_retune, needs_data=True),
)


def run_stages(at: str, run: StageRun, times: dict[str, float]) -> None:
    """Every registered stage of ``at`` that the recipe asks for, timed under its name."""
    for stage in STAGES:
        if stage.at == at and stage.applies(run.recipe):
            if stage.needs_data and run.batches is None:
                raise UsageError(f"{stage.name} needs calibration data (--calib-data)")
            t0 = time.perf_counter()
            run.extras[stage.name] = stage.run(run)
            times[stage.name] = time.perf_counter() - t0


def _quantize_model(model: nn.Module, recipe: Recipe, batches: Iterable | None,
                    progress, plan: QuantPlan | None,
                    activation_budget: int = 1 << 30,
                    first_tokens: dict | None = None) -> QuantizeResult:
    times: dict[str, float] = {}
    batches = list(batches) if batches is not None else None
    run = StageRun(model, recipe, plan, batches, progress, {})
    run_stages("model", run, times)  # before planning (a plan given is re-bound by them)
    plan = run.plan = run.plan if run.plan is not None else build_plan(model, recipe)
    recipe, facts = plan.recipe, plan.facts
    run.recipe = recipe  # the plan's (defaults resolved) from here on
    targets, experts, skipped = plan.gemms, plan.experts, plan.skipped
    if not targets and not experts and not facts.taps:  # taps alone: what the KV cache costs
        raise UsageError("no GEMM module left to quantize (check --skip / --override)")
    if batches is None and facts.needs_calibration:
        raise UsageError("this recipe needs calibration data (--calib-data); dynamic per-token "
                         "activations (--act-granularity token) alone need none")
    extras = run.extras
    if distributed.active() and facts.bn_retune:
        raise UsageError("--bn-retune is not supported across processes (torchrun); run it in "
                         "one process")
    run_stages("weights", run, times)

    t0 = time.perf_counter()
    taps = ActivationTaps(model, recipe) if facts.taps else None
    collector = None
    observer = ExpertObserver({e.name: (e.module, e.info) for e in experts},
                              all_experts=recipe.calibrate_all_experts) if experts else None
    in_order = facts.gptq_in_order and batches is not None
    one_pass = set(outside_blocks(model, targets)) if in_order else None  # the rest: in order
    hessian_from = [t for t in targets if reads_data(t)
                    and (one_pass is None or t.name in one_pass)]
    hessians = HessianCollector({t.name: t.module for t in hessian_from},
                                dtype=recipe.hessian_dtype_on("cpu"),  # summed on the host
                                diagonal=hessian_diagonal_only(hessian_from)) \
        if facts.gptq else None
    # the statistics pass, unless nothing reads it (dynamic inputs with in-order GPTQ alone)
    if batches is not None and (facts.needs_statistics_pass or observer is not None
                                or (hessians is not None and hessians.modules)):
        with taps.observing() if taps else nullcontext():
            collector = collect_stats(model, targets, batches, progress,
                                      sample_batches=SAMPLE_BATCHES if facts.layer_aware else 0,
                                      experts=observer, hessians=hessians)
        if taps is not None:
            distributed.reduce_stats(taps.stats)
    times["calibrate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    materialize_offloaded(model)  # accelerate-offloaded weights: in place before reading them
    stats = collector.stats if collector else {}
    gran = plan.weight_granularity()
    w_calib = plan.weight_calibrator()
    chosen = {}
    if facts.layer_aware and facts.static_inputs:
        chosen = choose_layerwise(model, targets, stats, collector.row_samples(), recipe, gran,
                                  w_calib, batches[:SAMPLE_BATCHES])
    a_calib = None if facts.layer_aware else plan.act_calibrator()
    reports, all_warnings = [], []
    groups = fused_groups([t.name for t in targets]) if unify_fused(recipe, targets) else []
    unified = unified_weight_scales(targets, groups, gran, w_calib, recipe, chosen)
    if hessians is not None:
        # "hessians_for": what the Hessians served: GPTQ's column sweep, or (``hmse``) only the
        # weight scales' choice, then rounding to nearest
        extras["gptq"] = {"hessians_for": "gptq" if weight_entry(recipe.weight_calib).rounding
                          == "gptq" else f"{recipe.weight_calib} scales (round to nearest)",
                          "hessian_bytes": hessians.nbytes, "damp": recipe.gptq_damp,
                          "act_order": recipe.gptq_act_order, "block": recipe.gptq_block,
                          "distinct_inputs": len(hessians.sums), "sequential": None}
    by_name: dict[str, ModuleReport] = {}

    def quantize_one(t: Target, hessian: torch.Tensor | None, aim=None) -> None:
        t_calib = w_calib if t.weight.calibrator == recipe.weight_calib else \
            plan.weight_calibrator(t)  # a partial-plan override's own
        by_name[t.name] = quantize_target(model, t, recipe, target_granularity(t, gran),
                                          t_calib, a_calib, stats.get(t.name),
                                          chosen.get(t.name), weight_scale=unified.get(t.name),
                                          hessian=hessian, aim=aim)

    swept: dict[str, dict] = {}  # experts swept by GPTQ in run order: their report entries
    if in_order:  # GEMMs in blocks, in run order, each Hessian from the model quantized so far
        expert_stats = observer.stats if observer is not None else {}
        extras["gptq"]["sequential"] = quantize_in_order(
            model, targets, {t.name for t in targets if reads_data(t)}, batches, quantize_one,
            aim=Aim.of(recipe, facts.causal_lm), activation_budget=activation_budget,
            first_tokens=first_tokens,
            hessian_dtype=recipe.hessian_dtype_on(_device_of(model)),
            experts=[e for e in experts if reads_data(e)],
            quantize_experts=lambda e, feed: sweep_experts(
                model, e, plan, gran, w_calib, expert_stats, feed, swept, all_warnings))
    for t in targets:
        if t.name not in by_name:
            quantize_one(t, hessians.hessian(t.name) if hessians and reads_data(t) else None)
    for t in targets:
        all_warnings += [f"{t.name}: {w}" for w in by_name[t.name].warnings]
        reports.append(by_name[t.name])
    if groups:
        extras["fused_groups"] = unify_input_scales(model, groups, reports)
    if experts:
        extras["experts"] = _quantize_all_experts(model, plan, gran, w_calib,
                                                  observer.stats if batches is not None else {},
                                                  all_warnings, swept)
    if taps is not None:
        extras["taps"] = taps.freeze(plan)
    times["quantize"] = time.perf_counter() - t0

    run_stages("after", run, times)
    extras["high_precision"] = high_precision_report(model)
    return QuantizeResult(model, reports, skipped, stats, times, all_warnings, extras,
                          recipe=recipe, plan=plan)


def _device_of(model: nn.Module) -> torch.device:
    """Where ``model`` computes: its first parameter's device (the CPU for one without)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _quantize_all_experts(model, plan: QuantPlan, gran, w_calib, stats: dict,
                          warnings: list[str], swept: dict) -> dict:
    """Quantize every fused-experts module (``swept``: the report entries of those GPTQ already
    swept in its run order, kept as they are). Layer-output-aware activation calibrators
    (best-of, pow2-search) search with one layer's cached input rows and weight; experts have
    one of each per expert, so they use the entry's statistics fallback here (recorded in the
    report)."""
    a_calib = plan.act_calibrator()
    unify = unify_fused(plan.recipe, plan.experts)
    return {e.name: swept[e.name] if e.name in swept else
            quantize_experts_module(model, e, plan.recipe, gran, w_calib, a_calib, stats,
                                    unify, warnings) for e in plan.experts}


def high_precision_report(model: nn.Module, top: int = 8) -> dict:
    """How many parameters stayed in high precision, and the largest such tensors: weights
    fp8ptq did not quantize are listed, never silently skipped. Quantized weights count with
    their number of codes."""
    quantized, replaced = 0, set()
    for m in model.modules():
        if isinstance(m, QuantGemm):
            quantized += m.inner.weight.numel()
            replaced.add(id(m.inner.weight))  # its dequantized stand-in, not a kept weight
        elif isinstance(m, QuantExperts):
            quantized += sum(m.codes(p).numel() for p in m.info.projections)
    kept = [(n, p.numel()) for n, p in model.named_parameters() if id(p) not in replaced]
    total = quantized + sum(c for _, c in kept)
    kept.sort(key=lambda x: -x[1])
    return {"quantized_parameters": quantized,
            "high_precision_parameters": sum(c for _, c in kept),
            "high_precision_fraction": sum(c for _, c in kept) / total if total else 0.0,
            "largest_high_precision": [{"name": n, "parameters": c} for n, c in kept[:top]]}

