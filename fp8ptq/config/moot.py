"""Recipe fields that have no effect under the resolved recipe (``moot_options``): warned about
by the commands, refused where a command line names both such a field and what makes it moot,
and recorded in ``fp8ptq.json``."""

from __future__ import annotations

from dataclasses import dataclass

from ..calibrators import registry as calibrators
from ..formats import get_format
from .recipe import Recipe, override_formats
from .schemes import expand_scheme

ACT_CAUSES = ("act_granularity", "act_format")  # fields that make activations dynamic


CALIB_FIELD = {"activation": "act_calib", "weight": "weight_calib"}


@dataclass(frozen=True)
class Moot:
    """A recipe field the resolved recipe ignores: why, and which fields make it so."""

    field: str
    reason: str
    causes: tuple[str, ...]


def moot_options(recipe: Recipe, given=None, *, convolutions: bool = False) -> list[Moot]:
    """The fields in ``given`` (default: those set to a non-default value, less what the
    scheme set) that have no effect under ``recipe``. Calibrator options come from the
    registry's option schemas: a field no calibrator in use reads is moot. ``convolutions``:
    the model has convolutions, whose default activations are static per tensor."""
    given = _given(recipe) if given is None else set(given)
    static, grans = _calibrated_activations(recipe, convolutions)
    in_use = _calibrators_in_use(recipe, static)
    out = [] if static else [Moot("act_calib", "no activation scale is calibrated ("
                                  + _dynamic_why(recipe) + ")", ACT_CAUSES)]
    for field, owners in _calibrator_options().items():
        if not owners & in_use:
            target = next(iter(owners))[0]
            names = ", ".join(sorted(n for _, n in owners))
            if target == "activation" and ("activation", recipe.act_calib) in owners:
                out.append(Moot(field, f"{recipe.act_calib} calibrates no activation scale "
                                f"here ({_dynamic_why(recipe)})", ACT_CAUSES))
            else:
                out.append(Moot(field, f"read only by the {target} calibrator(s) {names}",
                                (CALIB_FIELD[target],)))
    weight_grans = {recipe.weight_granularity} | _override_values(recipe, "weight_granularity")
    if "block" not in weight_grans:
        out.append(Moot("block_size", "weights are not in blocks", ("weight_granularity",)))
    if "group" not in grans:
        out.append(Moot("act_group_size", "no activation is quantized per group",
                        ("act_granularity",)))
    if recipe.smoothquant is None:
        out.append(Moot("smoothquant_into", "SmoothQuant is off", ("smoothquant",)))
    if recipe.calib_windows != "documents":
        out.append(Moot("calib_prefix_token", "random calibration windows open with no start "
                        "token", ("calib_windows",)))
    if recipe.gptq_asym or recipe.gptq_sink == 0 or not recipe.gptq_sequential:
        out.append(Moot("gptq_sink_target", "sink-aware GPTQ is off",
                        ("gptq_sink", "gptq_asym", "gptq_sequential")))
    if recipe.kv_cache is None:
        out.append(Moot("kv_granularity", "the KV cache is not quantized", ("kv_cache",)))
    return [m for m in out if m.field in given]


def _given(recipe: Recipe) -> set[str]:
    scheme = expand_scheme(recipe.scheme) if recipe.scheme else {}
    fields = type(recipe).model_fields
    return {k for k in recipe.model_fields_set if getattr(recipe, k) != fields[k].default
            and (k not in scheme or scheme[k] != getattr(recipe, k))}


def _override_values(recipe: Recipe, key: str) -> set:
    return {v[key] for v in recipe.overrides.values() if isinstance(v, dict) and key in v}


def _calibrated_activations(recipe: Recipe, convolutions: bool) -> tuple[bool, set[str]]:
    """(whether any activation scale is calibrated, the activation granularities in use)."""
    grans = {recipe.act_granularity} | _override_values(recipe, "act_granularity")
    if convolutions and "act_granularity" not in recipe.model_fields_set:
        grans.add("tensor")  # a convolution's default (plan.py)
    act = recipe.act_format or recipe.format
    acts = {act} | {f for v in recipe.overrides.values()
                    for k, f in override_formats(v).items() if k == "act_format"}
    static_format = any(a != "none" and get_format(a).mx_block is None for a in acts)
    taps = recipe.quantize_attention or recipe.quantize_residual
    return taps or (static_format and "tensor" in grans), grans


def _dynamic_why(recipe: Recipe) -> str:
    act = recipe.act_format or recipe.format
    if act == "none":
        return "weight-only"
    if get_format(act).mx_block is not None:
        return f"{act} activations are dynamic"
    return f"activations are dynamic per {recipe.act_granularity}"


def _calibrators_in_use(recipe: Recipe, static: bool) -> set[tuple[str, str]]:
    weights = {recipe.weight_calib} | _override_values(recipe, "weight_calib")
    used = {("weight", n) for n in weights}
    if static:
        used |= {("activation", recipe.act_calib),
                 ("activation", calibrators.statistics_entry(recipe.act_calib).name)}
    return used


def _calibrator_options() -> dict[str, set[tuple[str, str]]]:
    """Every calibrator option field -> the (target, name) of the calibrators that read it."""
    out: dict[str, set[tuple[str, str]]] = {}
    for target in ("activation", "weight"):
        for name in calibrators.names(target):
            for field in calibrators.entry(target, name).options:
                out.setdefault(field, set()).add((target, name))
    return out
