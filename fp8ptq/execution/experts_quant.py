"""The in-memory run's fused MoE experts: each experts module becomes its ``QuantExperts``,
rounded to nearest or, where sequential GPTQ reaches it in its block, swept expert by expert
(``fp8ptq.algorithms.gptq.experts``)."""

from __future__ import annotations

from ..algorithms.gptq.experts import ExpertRounding, Feed, gptq_experts
from ..calibrators.registry import weight_entry
from ..config.plan import ModulePlan, QuantPlan, needs_full_hessian
from ..config.recipe import Recipe
from ..model.gemm import set_submodule
from ..nn.fused import unify_fused
from ..nn.quant_experts import quantize_experts, unify_expert_input_scales


def quantize_all_experts(model, plan: QuantPlan, gran, w_calib, stats: dict,
                         warnings: list[str], swept: dict | None = None) -> dict:
    """Quantize every fused-experts module (``swept``: the report entries of those GPTQ
    already swept, kept as they are). Layer-output-aware activation calibrators (best-of,
    pow2-search) search with one layer's cached input rows and weight; experts have one of each
    per expert, so they use the entry's statistics fallback here (recorded in the report)."""
    swept = swept or {}
    a_calib = plan.act_calibrator()
    unify = unify_fused(plan.recipe, plan.experts)
    return {e.name: swept[e.name] if e.name in swept else
            quantize_experts_module(model, e, plan.recipe, gran, w_calib, a_calib, stats,
                                    unify, warnings) for e in plan.experts}


def quantize_experts_module(model, e: ModulePlan, recipe: Recipe, gran, w_calib, a_calib,
                            stats: dict, unify: bool, warnings: list[str],
                            round_expert=None) -> dict:
    """Replace the experts module ``e`` with its ``QuantExperts``; its report entry.
    ``round_expert``: GPTQ's rounding of the experts it has a Hessian for
    (``quantize_experts``)."""
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


def sweep_experts(model, e: ModulePlan, plan: QuantPlan, gran, w_calib, stats: dict,
                  feed: Feed, swept: dict, warnings: list[str]) -> dict:
    """``e`` quantized by GPTQ where sequential GPTQ reaches it (``gptq_experts``); its report
    entry goes to ``swept``, with the facts of the sweep under ``gptq`` (experts swept per
    projection, those left rounded to nearest, the Hessians' peak bytes)."""
    recipe = plan.recipe
    rounding = ExpertRounding(
        e.weight_format, gran, w_calib, sweep=needs_full_hessian(e), damp=recipe.gptq_damp,
        act_order=recipe.gptq_act_order, block=recipe.gptq_block, rounding=recipe.rounding,
        pow2=recipe.scale_pow2, all_tokens=recipe.gptq_all_experts,
        dtype=recipe.hessian_dtype)

    def build(round_first):
        swept[e.name] = quantize_experts_module(
            model, e, recipe, gran, w_calib, plan.act_calibrator(), stats,
            unify_fused(recipe, plan.experts), warnings, round_expert=round_first)
        return model.get_submodule(e.name)

    facts = gptq_experts(e.module, e.info, feed, build, rounding)
    entry = swept[e.name]
    down = e.info.projections[-1]
    q = model.get_submodule(e.name)
    entry["projections"][down].update(
        weight_sqnr_db_min=facts.pop("down_sqnr_db_min"),
        weight_scale_min=float(q.weight_scale(down).min()),
        weight_scale_max=float(q.weight_scale(down).max()))
    if facts["rounded_to_nearest"]:
        facts["warnings"].append(
            f"expert(s) {facts['rounded_to_nearest']} received no calibration token: rounded "
            "to nearest instead of GPTQ")
    entry["warnings"] += facts["warnings"]
    warnings += [f"{e.name}: {w}" for w in facts["warnings"]]
    entry["gptq"] = facts
    return facts
