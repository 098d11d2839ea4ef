"""The quantize pipeline: one calibration pass -> scales -> ``QuantGemm`` modules -> report."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ..algorithms.bn_retune import retune_batchnorm
from ..algorithms.gptq.sequential import Aim, outside_blocks, quantize_in_order
from ..algorithms.gptq.sweep import gptq_codes
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
from ..errors import NumericsError, UsageError
from ..formats import decode
from ..formats.scales import amax_to_scale, histogram_sqnr_db, sqnr_db
from ..formats.weight_quant import choose_scale, quantize_weight
from ..model.forward import (  # noqa: F401 - run_batch, token_batches re-exported
    head_observed,
    micro_batches,
    run_batch,
    token_batches,
)
from ..model.gemm import input_channel_dim, kind, set_submodule, weight_2d
from ..model.gemm32 import float32_gemms
from ..model.lean import lean_forwards
from ..nn.fused import (
    fused_groups,
    unified_weight_scales,
    unify_fused,
    unify_input_scales,
)
from ..nn.quant_experts import ExpertObserver, QuantExperts
from ..nn.quant_gemm import QuantGemm, simulated_gemms
from ..observe.hessian import HessianCollector
from ..observe.observers import StatsCollector, TensorStats
from ..observe.taps import ActivationTaps
from ..runtime.usage import release_free_memory
from . import distributed
from .experts_quant import quantize_all_experts, quantize_experts_module, sweep_experts  # noqa: F401
from .placement import materialize_offloaded

# The plan's module entries (``fp8ptq.config.plan``) are what the pipeline quantizes; the old names
# stay.
Target = ExpertsTarget = ModulePlan


@dataclass
class ModuleReport:
    name: str
    kind: str
    weight_format: str
    act_format: str | None
    weight_amax: float
    weight_scale_min: float
    weight_scale_max: float
    weight_sqnr_db: float
    input_amax: float | None = None
    input_scale: float | None = None
    input_sqnr_db: float | None = None
    warnings: list[str] = field(default_factory=list)
    act_calib: str | None = None  # which calibrator set the input scale (best-of records its pick)


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


def plan_targets(model: nn.Module, recipe: Recipe) -> tuple[list[ModulePlan], list[str]]:
    """Which GEMMs get quantized, in which formats, and which are skipped (``plan.plan_gemms``)."""
    return plan_gemms(model, recipe)


def collect_stats(model: nn.Module, targets: list[Target], batches: list, progress=None,
                  sample_batches: int = 0, taps=None, experts: ExpertObserver | None = None,
                  hessians: HessianCollector | None = None) -> StatsCollector:
    """Run the calibration data through the model once, observing every target's input (and,
    with ``experts``, every expert's GEMM inputs)."""
    modules = {t.name: t.module for t in targets}
    dims = {t.name: input_channel_dim(t.module) for t in targets}
    collector = StatsCollector(modules, dims, sample_batches=sample_batches)
    logits = head_observed(model, modules.values())  # else the head runs on one position
    error = None
    # micro-batches where every statistic adds exactly (GPTQ's X^T X sums would not)
    split = hessians is None or not hessians.modules
    with collector.observing(), experts.observing() if experts else nullcontext(), \
            hessians.observing() if hessians else nullcontext(), torch.inference_mode(), \
            float32_gemms(model=model), lean_forwards(model):
        try:
            # under torchrun each rank runs its share; global indices keep sample order
            for index, batch in distributed.shard(batches):
                collector.batch_index = index
                stride = collector.row_stride if index < sample_batches else 1
                for part in micro_batches(batch, multiple=stride) if split else [batch]:
                    run_batch(model, part, logits=logits)
                release_free_memory()
                if progress is not None:
                    progress()
        except Exception as e:  # noqa: BLE001 - re-raised by agree, on every rank
            error = e
    distributed.agree(error)
    if distributed.active():
        distributed.reduce_stats(collector.stats)
        collector.samples = distributed.gather_samples(collector.samples)
        if experts is not None:
            distributed.reduce_stats(experts.stats)
        if hessians is not None:
            distributed.reduce_sums(hessians.sums, hessians.rows)
    return collector


def calibration_passes(recipe: Recipe) -> int:
    """How many times the calibration batches go through the model (for progress bars)."""
    return run_facts(recipe).passes


def quantize_model(model: nn.Module, recipe: Recipe, batches: Iterable | None = None,
                   progress=None, plan: QuantPlan | None = None) -> QuantizeResult:
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
    ``fp8ptq`` command bounds the heap: ``fp8ptq.runtime.usage.bound_heap``)."""
    with float32_gemms(model=model), simulated_gemms():
        return _quantize_model(model, recipe, batches, progress, plan)


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
                    progress, plan: QuantPlan | None) -> QuantizeResult:
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
                                dtype=recipe.hessian_dtype,
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
            aim=Aim.of(recipe, facts.causal_lm), hessian_dtype=recipe.hessian_dtype,
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
        extras["experts"] = quantize_all_experts(model, plan, gran, w_calib,
                                                 observer.stats if batches is not None else {},
                                                 all_warnings, swept)
    if taps is not None:
        extras["taps"] = taps.freeze(plan)
    times["quantize"] = time.perf_counter() - t0

    run_stages("after", run, times)
    extras["high_precision"] = high_precision_report(model)
    return QuantizeResult(model, reports, skipped, stats, times, all_warnings, extras,
                          recipe=recipe, plan=plan)


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


def target_granularity(t: Target, gran):
    """The weight granularity object of ``t``: the recipe's (``gran``, shared, so a layer-aware
    choice made with it stays valid) unless the module's plan differs (an MX format's groups)."""
    return gran if t.weight.granularity == gran.name else t.weight.handler()


def quantize_target(model, t: Target, recipe, gran, w_calib, a_calib, stats, chosen=None,
                    weight_scale: torch.Tensor | None = None,
                    hessian: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                    aim: torch.Tensor | None = None):
    """``chosen``: scales a layer-aware calibrator already picked (``LayerChoice``);
    ``aim``: the weight GPTQ aims at instead of the module's (asymmetric GPTQ's ``W*``, on
    which the scale is then chosen too: it is what gets rounded);
    ``weight_scale``: a scale decided for a group of fused shards (``unified_weight_scales``);
    ``weight``: the weight, in the module's own layout, when the module holds none (the
    model-free path: a meta-device module; its ``QuantGemm`` then holds the codes)."""
    warnings: list[str] = []
    w2d = weight_2d(t.module, weight).detach()  # its own dtype: the sweep converts by chunks
    if aim is not None and hessian is not None:
        w2d = aim.to(torch.float32)
    if weight_scale is not None:
        w_scale = weight_scale
    elif chosen is not None and chosen.weight_scale is not None:
        w_scale, gran = chosen.weight_scale, chosen.weight_granularity
    else:
        w_scale = choose_scale(w2d, t.weight_format, gran, w_calib, pow2=recipe.scale_pow2,
                               warnings=warnings, hessian=hessian)
    gptq = weight_entry(t.weight.calibrator).rounding == "gptq"
    if gptq and hessian is not None:
        w2d = w2d.float()
        if not bool(torch.isfinite(w2d).all()):
            raise NumericsError(f"weight of {t.name} contains NaN or inf; refusing to quantize "
                                "it")
        codes = gptq_codes(w2d, hessian, gran.expand(w_scale, w2d), t.weight_format,
                           damp=recipe.gptq_damp, act_order=recipe.gptq_act_order,
                           block=recipe.gptq_block, rounding=recipe.rounding)
        deq = decode(codes, t.weight_format) * gran.expand(w_scale, w2d)
        w_amax, w_sqnr = float(w2d.abs().max()), sqnr_db(w2d, deq)
    else:
        if gptq:
            warnings.append("no Hessian (a convolution, or no calibration input): rounded to "
                            "nearest instead of GPTQ")
        qw = quantize_weight(w2d, w_scale, t.weight_format, gran, rounding=recipe.rounding,
                             name=t.name)
        codes, w_amax, w_sqnr = qw.codes, qw.amax, qw.sqnr_db

    input_scale, input_amax, input_sqnr = None, None, None
    if t.input is not None and t.input.static:
        if stats is None or not stats.seen:
            warnings.append("saw no calibration tokens (unused module?)")
            input_amax = 0.0
        else:
            if stats.nonfinite:
                warnings.append(f"{stats.nonfinite} non-finite input values ignored")
            input_amax = chosen.input_amax if chosen is not None else a_calib.amax(
                stats, t.act_format)
        if chosen is not None and chosen.input_scale is not None:
            input_scale = chosen.input_scale
        else:
            input_scale = amax_to_scale(input_amax, t.act_format, pow2=recipe.scale_pow2,
                                        what="input", warnings=warnings)
        if stats is not None and stats.seen:
            input_sqnr = histogram_sqnr_db(stats, float(input_scale), t.act_format)

    act = {} if t.input is None else dict(act_granularity=t.input.granularity,
                                          act_group_size=t.input.group_size)
    q = QuantGemm(t.module, weight_format=t.weight_format, weight_codes=codes,
                  weight_scale=w_scale, weight_granularity=gran, act_format=t.act_format,
                  input_scale=input_scale, **act)
    set_submodule(model, t.name, q)
    return ModuleReport(
        name=t.name, kind=kind(t.module), weight_format=t.weight_format.name,
        act_format=t.act_format.name if t.act_format else None,
        weight_amax=w_amax, weight_scale_min=float(w_scale.min()),
        weight_scale_max=float(w_scale.max()), weight_sqnr_db=w_sqnr,
        input_amax=input_amax, input_scale=None if input_scale is None else float(input_scale),
        input_sqnr_db=input_sqnr, warnings=warnings,
        act_calib=chosen.method if chosen is not None else
        (t.input.calibrator if t.input else recipe.act_calib))
