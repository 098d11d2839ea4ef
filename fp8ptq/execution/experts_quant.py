"""The in-memory run's fused MoE experts swept by GPTQ where sequential GPTQ reaches them in
their block (``fp8ptq.algorithms.gptq.experts``); the others are rounded to nearest by
``fp8ptq.steps.quantize_module.quantize_experts_module``."""

from __future__ import annotations

from ..algorithms.gptq.experts import ExpertRounding, Feed, gptq_experts
from ..config.plan import ModulePlan, QuantPlan, needs_full_hessian
from ..nn.fused import unify_fused
from ..steps.quantize_module import quantize_experts_module


def sweep_experts(model, e: ModulePlan, plan: QuantPlan, gran, w_calib, stats: dict,
                  feed: Feed, swept: dict, warnings: list[str]) -> dict:
    """``e`` quantized by GPTQ where sequential GPTQ reaches it (``gptq_experts``); its report
    entry goes to ``swept``, with the facts of the sweep under ``gptq`` (experts swept per
    projection, those left rounded to nearest, the Hessians' peak bytes)."""
    recipe = plan.recipe
    device = getattr(e.module, e.info.projections[0]).device
    rounding = ExpertRounding(
        e.weight_format, gran, w_calib, sweep=needs_full_hessian(e), damp=recipe.gptq_damp,
        act_order=recipe.gptq_act_order, block=recipe.gptq_block, rounding=recipe.rounding,
        pow2=recipe.scale_pow2, all_tokens=recipe.gptq_all_experts,
        dtype=recipe.hessian_dtype_on(device), sweep_dtype=recipe.sweep_dtype_on(device))

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
