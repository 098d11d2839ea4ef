"""The greedy suggestion: which units to keep in high precision or move to another measured
format so that the estimated total delta stays under ``--target-delta``, as ``quantize``
flags."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.recipe import Recipe
from ..errors import UsageError

# The calibration-size flags describe this run's (small) slice; quantize keeps its own defaults.
NOT_SUGGESTED = ("format", "weight_format", "act_format", "skip", "overrides", "num_samples",
                 "seq_len", "batch_size", "seed")


def parse_target(text: str) -> tuple[float, bool]:
    """``"1%"`` -> (0.01, True: relative), ``"0.5"`` -> (0.5, False: absolute)."""
    s = str(text).strip()
    relative = s.endswith("%")
    try:
        value = float(s[:-1] if relative else s)
    except ValueError:
        raise UsageError(f"--target-delta expects VALUE or VALUE% (e.g. 0.5 or 1%), got "
                         f"{text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"--target-delta must be a finite value >= 0, got {text!r}")
    return (value / 100 if relative else value), relative


def target_value(target: str, metric: str, baseline: float | None) -> float:
    """The allowed total delta: ppl relative targets are fractions of the baseline perplexity;
    sqnr deltas are noise-to-signal ratios, so "1%" and "0.01" are the same."""
    value, relative = parse_target(target)
    return value * baseline if relative and metric == "ppl" else value


@dataclass
class Suggestion:
    format: str
    target: str
    target_delta: float
    estimated_delta_all: float  # every unit quantized in ``format``
    estimated_delta: float  # with the suggestion applied
    skip: list[str]  # globs kept in high precision
    overrides: dict[str, str]  # globs moved to another evaluated format
    delta_scale: float = 1.0  # factor applied to the unit deltas (see DEFINITIONS)


def _unnan(delta: float) -> float:
    """A delta that could not be measured (NaN) counts as the worst."""
    return math.inf if math.isnan(delta) else delta


def _cost(delta: float) -> float:
    return max(_unnan(delta), 0.0)


def suggest(deltas: dict[str, dict[str, float]], patterns: dict[str, str], primary: str,
            target: str, target_delta: float) -> Suggestion:
    """Greedy: while the estimated total delta (sum over units) exceeds the target, take the
    unit that costs most now and move it to its least sensitive other evaluated format, or,
    when none is better, keep it in high precision."""
    choice = {u: primary for u in deltas}

    def cost(u):
        return 0.0 if choice[u] is None else _cost(deltas[u][choice[u]])

    total_all = sum(cost(u) for u in deltas)
    total = total_all
    while total > target_delta:
        unit = max((u for u in deltas if choice[u] is not None), key=cost)
        better = [f for f in deltas[unit] if _cost(deltas[unit][f]) < cost(unit)]
        choice[unit] = min(better, key=lambda f: _cost(deltas[unit][f])) if better else None
        total = sum(cost(u) for u in deltas)
    return Suggestion(
        format=primary, target=target, target_delta=target_delta, estimated_delta_all=total_all,
        estimated_delta=total,
        skip=[patterns[u] for u in deltas if choice[u] is None],
        overrides={patterns[u]: choice[u] for u in deltas if choice[u] not in (None, primary)})


def quantize_flags(recipe: Recipe, suggestion: Suggestion) -> list[str]:
    """``fp8ptq quantize`` flags for ``recipe`` (where it differs from the defaults, less the
    calibration-size flags) with the suggestion applied."""
    flags = ["--format", suggestion.format]
    # the defaults given the same calibration data (the weight calibrator's depends on it)
    default = Recipe(calib_data=recipe.calib_data)
    for name in Recipe.model_fields:
        value = getattr(recipe, name)
        if name in NOT_SUGGESTED or (name != "calib_data" and value == getattr(default, name)) \
                or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # on-by-default GPTQ switches are turned off by --no-
            flags += [flag] if value else (["--no-" + flag[2:]] if name.startswith("gptq_")
                                           else [])
        elif isinstance(value, tuple):
            flags += [flag, ",".join(map(str, value))]
        else:
            flags += [flag, str(value)]
    for pattern in [*recipe.skip, *suggestion.skip]:
        flags += ["--skip", pattern]
    for pattern, fmt in {**recipe.overrides, **suggestion.overrides}.items():
        flags += ["--override", f"{pattern}={fmt}"]
    return flags
