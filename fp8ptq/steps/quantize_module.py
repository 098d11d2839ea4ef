"""Quantizing one module: a GEMM's weight scale and codes (rounded to nearest, or by GPTQ with
its Hessian), its static input scale, the ``QuantGemm`` put in its place and its report row; an
experts module's ``QuantExperts`` likewise."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..algorithms.gptq.sweep import Precision, gptq_codes
from ..calibrators.registry import weight_entry
from ..config.plan import ModulePlan
from ..config.recipe import Recipe
from ..errors import NumericsError
from ..formats import decode
from ..formats.scales import amax_to_scale, histogram_sqnr_db, sqnr_db
from ..formats.weight_quant import choose_scale, quantize_weight
from ..model.gemm import kind, set_submodule, weight_2d
from ..nn.quant_experts import quantize_experts, unify_expert_input_scales
from ..nn.quant_gemm import QuantGemm

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


def quantize_experts_module(model, e: ModulePlan, recipe: Recipe, gran, w_calib, a_calib,
                            stats: dict, unify: bool, warnings: list[str],
                            round_expert=None) -> dict:
    """Replace the experts module ``e`` with its ``QuantExperts``; its report entry.
    ``round_expert``: GPTQ's rounding of the experts it has a Hessian for
    (``quantize_experts``; ``fp8ptq.algorithms.gptq.experts``)."""
    q, rep = quantize_experts(
        e.name, e.module, e.info, weight_format=e.weight_format, act_format=e.act_format,
        act_granularity=recipe.act_granularity, gran=gran, w_calib=w_calib, a_calib=a_calib,
        stats=stats, rounding=recipe.rounding, pow2=recipe.scale_pow2,
        round_expert=round_expert)
    if unify:
        unify_expert_input_scales(q)
        rep.projections = {p: {**f, "input_scales": None if q.input_scale(p) is None else
                               [float(s) for s in q.input_scale(p)]}
                           for p, f in rep.projections.items()}
    set_submodule(model, e.name, q)
    if round_expert is None and weight_entry(e.weight.calibrator).rounding == "gptq":
        rep.warnings.append("GPTQ sweeps fused MoE experts only in sequential GPTQ "
                            "(--gptq-sequential) with calibration data: rounded to nearest")
    warnings += [f"{e.name}: {w}" for w in rep.warnings]
    return {"num_experts": rep.num_experts, "weight_format": rep.weight_format,
            "act_format": rep.act_format, "act_calib": a_calib.name,
            "parameters": rep.parameters, "projections": rep.projections,
            "warnings": rep.warnings}


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
                           block=recipe.gptq_block, rounding=recipe.rounding,
                           sweep_dtype=Precision(*recipe.sweep_dtype_on(w2d.device)))
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
