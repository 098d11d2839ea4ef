"""Swapping one unit for the ``QuantGemm`` modules ``quantize`` would build, and back: the
plan of each format is built once (``fp8ptq.config.plan``), the swap is measured, nothing is
reloaded."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..calibrators.layerwise import choose_layerwise
from ..config.plan import SAMPLE_BATCHES, QuantPlan, build_plan, reads_data
from ..config.recipe import Recipe
from ..formats.scales import sqnr_db
from ..model.gemm import set_submodule, weight_2d
from ..observe.hessian import HessianCollector
from ..steps.quantize_module import quantize_target, target_granularity
from .statistics import FormatStats, _db, _nsr


@dataclass
class FormatPlan:
    """Everything ``pipeline`` decides once per recipe, here once per format."""

    recipe: Recipe
    targets: dict
    granularity: object
    weight_calib: object
    act_calib: object
    chosen: dict


def format_recipe(recipe: Recipe, fmt: str) -> Recipe:
    """``recipe`` with weights and activations in ``fmt`` (weight-only stays weight-only)."""
    return recipe.replace(format=fmt, weight_format=None,
                          act_format="none" if recipe.act_format == "none" else None)


def plan_format(model, recipe: Recipe, fmt: str | None = None) -> QuantPlan:
    """The plan (``fp8ptq.config.plan``) of ``recipe`` in ``fmt`` (None: as ``recipe`` says):
    the one place the sensitivity analysis plans, once per format (or ``--target-delta``
    rung) of a run; a streamed analysis plans the whole model once and measures each block
    with its part (``QuantPlan.part``)."""
    return build_plan(model, recipe if fmt is None else format_recipe(recipe, fmt))


def format_plan(model, recipe: Recipe, fmt: str | None, collector, batches,
                plan: QuantPlan | None = None) -> FormatPlan:
    """The run's plan (``plan_format``) for ``recipe`` in ``fmt`` (None: as ``recipe`` says),
    with its calibrators built and any layer-aware choice made once. ``plan``: that plan made
    already (streamed analysis: one block's part of the whole model's plan)."""
    if plan is None:
        plan = plan_format(model, recipe, fmt)
    gran, w_calib = plan.weight_granularity(), plan.weight_calibrator()
    chosen = {}
    if plan.facts.layer_aware and plan.facts.static_inputs:
        chosen = choose_layerwise(model, plan.gemms, collector.stats, collector.row_samples(),
                                  plan.recipe, gran, w_calib, batches[:SAMPLE_BATCHES])
    a_calib = None if plan.facts.layer_aware else plan.act_calibrator()
    return FormatPlan(plan.recipe, {t.name: t for t in plan.gemms}, gran, w_calib, a_calib,
                      chosen)


@dataclass
class Swap:
    name: str
    report: object  # pipeline.ModuleReport
    quant: nn.Module  # the QuantGemm in the model now
    weight: torch.Tensor  # the original 2-D weight


@contextmanager
def swapped(model: nn.Module, plan: FormatPlan, names: list[str], stats: dict,
            hessians: HessianCollector | None = None):
    """Quantize ``names`` as ``quantize`` would, yield the ``Swap``s, then put the originals
    back (``QuantGemm`` replaces the inner weight's data; the original tensor is kept).
    ``hessians``: the calibration pass's GPTQ Hessians, for plans whose weights use GPTQ."""
    saved, swaps = [], []
    try:
        for name in names:
            t = plan.targets[name]
            w = t.module.weight
            saved.append((name, t.module, w.data, w.requires_grad))
            original_2d = weight_2d(t.module).detach()
            gptq = hessians is not None and reads_data(t)
            report = quantize_target(model, t, plan.recipe,
                                      target_granularity(t, plan.granularity),
                                      plan.weight_calib, plan.act_calib, stats.get(name),
                                      plan.chosen.get(name),
                                      hessian=hessians.hessian(name) if gptq else None)
            swaps.append(Swap(name, report, model.get_submodule(name), original_2d))
        yield swaps
    finally:
        for name, module, data, grad in reversed(saved):
            module.weight.data = data
            module.weight.requires_grad_(grad)
            set_submodule(model, name, module)


def output_sqnr_db(swap: Swap, rows: torch.Tensor | None) -> float | None:
    """SQNR of the GEMM output on sampled input rows, in float32 (None for convolutions, whose
    samples are channel rows, not patches)."""
    q = swap.quant
    if rows is None or q.kind not in ("linear", "conv1d_hf"):
        return None
    x = rows.to(swap.weight.device, torch.float32)
    bias = 0 if q.bias is None else q.bias.detach().float()
    with torch.no_grad():
        y = x @ swap.weight.float().T + bias
        xq = q.quantize_input(x) if q.act_format is not None else x
        yq = xq @ q.dequantized_weight_2d().float().T + bias
    return sqnr_db(y, yq)


def format_stats(swap: Swap, rows) -> FormatStats:
    r = swap.report
    out = output_sqnr_db(swap, rows)
    if out is None:
        out = _db(_nsr(r.weight_sqnr_db) + _nsr(r.input_sqnr_db))
    return FormatStats(r.weight_scale_min, r.weight_scale_max, r.weight_sqnr_db, r.input_scale,
                       r.input_sqnr_db, out, r.act_calib if r.act_format else None,
                       list(r.warnings))
