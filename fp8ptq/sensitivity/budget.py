"""``quantize --target-delta 1%``: per module, the cheapest recipe that keeps the predicted loss
within a target, then the real loss measured.

1. One calibration pass (``sensitivity.Session``: the statistics ``quantize`` uses, plus GPTQ's
   Hessians when a rung needs them) and a baseline perplexity on a held-out slice.
2. A *ladder* of choices per module, cheapest first, each including the rungs below it:
   ``base`` (the recipe), ``gptq`` (error-compensating rounding: costs quantize time only),
   ``finer`` (a finer granularity: static per-tensor -> dynamic per-token activations, or
   per-tensor -> per-channel weights: a little runtime), ``fallback`` (``--fallback-format``:
   ``bf16`` keeps the module in high precision -- memory and speed -- or another format).
3. Every unit (a GEMM, or a decoder block with ``--target-level block``) is quantized alone with
   every rung and measured on the held-out slice (the sensitivity sweep, with replay of the
   unchanged layers): its perplexity delta (metric ``ppl``), or its mean KL against the
   unquantized model's next-token distributions (metric ``kl``, ``lm_probes.KLProbe``: never
   negative per token, so a small effect does not drown in the signed noise of a perplexity
   delta; units add in nats, the prediction is exp(sum) - 1).
4. Greedy assignment: while the summed predicted delta exceeds the target, the move with the
   largest predicted gain per unit of cost (any higher rung of any unit) is taken.
5. The decisions become partial-plan overrides (``{weight_calib: gptq}``, ``{act_granularity:
   token}``, ``none``), the model is quantized with them by the normal pipeline, and the final
   model's delta is measured on the same held-out slice: predicted vs measured, both recorded in
   fp8ptq.json (``extras.target_delta``) and the report.
6. The final model is also checked on a verification slice the choices were not made on
   (``verify``: 2048-token windows, each opening a held-out document after the BOS, like the
   evaluation's articles; ``job.selection_and_verify`` gives it every other held-out document,
   so it shares no token with the selection slice), which says how far the prediction carries
   beyond its own slice; it is the headline (``TargetResult.headline``).

Summing per-unit deltas assumes they add up (first-order: small, independent perturbations);
the measured number says how well that held (docs/results/studies.md has the measurement).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..calibrators import registry as calibrators
from ..config.recipe import Recipe
from ..errors import UsageError
from ..formats import get_format
from ..steps.calibrate import plan_targets
from . import LEVELS, Session, parse_target, target_value
from .probes import KLProbe, PerplexityProbe

# --fallback-format values that mean "keep the module in high precision" (skip it)
HIGH_PRECISION = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "none", "skip")
COSTS = {"base": 0.0, "gptq": 1.0, "finer": 2.0, "fallback": 4.0}
HELDOUT_EVERY = 10  # with the calibration text as target data: every 10th document held out
METRICS = ("kl", "ppl")  # --target-metric: what a unit's sensitivity is measured by


@dataclass(frozen=True)
class Rung:
    name: str  # base | gptq | finer | fallback
    fields: dict  # what a module on this rung overrides ({} = the recipe; {"format": "none"})
    cost: float

    @property
    def skip(self) -> bool:
        return self.fields.get("format") == "none"

    def override(self):
        """The ``--override`` value for a module on this rung (a partial plan, or ``none``)."""
        return "none" if self.skip else dict(self.fields)

    def recipe(self, recipe: Recipe) -> Recipe:
        """``recipe`` with this rung applied to every module (the sweep's plan)."""
        fields = dict(self.fields)
        if "format" in fields:
            fields.update(weight_format=None,
                          act_format="none" if recipe.act_format == "none" else None)
        return recipe.replace(**fields) if fields else recipe


def ladder(recipe: Recipe, fallback: str = "bf16") -> list[Rung]:
    """The choices for a module, cheapest first; each rung keeps what the rungs below it add."""
    rungs = [Rung("base", {}, COSTS["base"])]
    fields: dict = {}
    if calibrators.weight_entry(recipe.weight_calib).rounding != "gptq":
        fields["weight_calib"] = calibrators.gptq_variant(recipe.weight_calib)
        rungs.append(Rung("gptq", dict(fields), COSTS["gptq"]))
    weight_only = recipe.act_format == "none"
    if recipe.act_granularity == "tensor" and not weight_only:
        rungs.append(Rung("finer", {**fields, "act_granularity": "token"}, COSTS["finer"]))
    elif recipe.weight_granularity == "tensor":
        rungs.append(Rung("finer", {**fields, "weight_granularity": "channel"}, COSTS["finer"]))
    if fallback.lower() in HIGH_PRECISION:
        rungs.append(Rung("fallback", {"format": "none"}, COSTS["fallback"]))
    else:
        rungs.append(Rung("fallback", {**fields, "format": get_format(fallback).name},
                          COSTS["fallback"]))
    return rungs


def assign(deltas: dict[str, dict[str, float]], rungs: list[Rung], budget: float
           ) -> dict[str, str]:
    """Per unit the rung to use: start every unit on the cheapest rung; while the summed
    predicted delta (negative deltas count as 0) exceeds ``budget``, take the move -- one unit to
    a higher rung with a lower delta -- with the largest gain per cost (ties: the larger gain)."""
    order = [r.name for r in rungs]
    cost = {r.name: r.cost for r in rungs}
    choice = {u: order[0] for u in deltas}

    def d(u, rung):
        return max(deltas[u][rung], 0.0)

    while sum(d(u, choice[u]) for u in deltas) > budget:
        best = None
        for u in deltas:
            here = d(u, choice[u])
            for rung in order[order.index(choice[u]) + 1:]:
                gain = here - d(u, rung)
                if gain <= 0:
                    continue
                key = (gain / max(cost[rung] - cost[choice[u]], 1e-9), gain)
                if best is None or key > best[0]:
                    best = (key, u, rung)
        if best is None:  # nothing lowers the sum any further
            break
        choice[best[1]] = best[2]
    return choice


@dataclass
class UnitDecision:
    unit: str
    pattern: str  # the --override glob of the unit
    modules: list[str]
    rung: str
    deltas: dict[str, float]  # the unit alone, per rung: KL (nats/token) or perplexity delta
    # the unit alone, per rung, its perplexity delta on the same slice (with metric "kl" the
    # probe scores both from the same logits: the diagnostics of docs/results/studies.md)
    ppl_deltas: dict[str, float] = field(default_factory=dict)


@dataclass
class TargetResult:
    target: str  # as given, e.g. "1%"
    budget: float  # allowed perplexity delta (absolute)
    baseline: float  # held-out perplexity, unquantized
    predicted: float  # perplexity delta predicted for the decisions (absolute)
    predicted_base: float  # the same with every unit on the base rung
    level: str
    rungs: list[dict]
    units: list[UnitDecision]
    overrides: dict  # glob -> partial plan / "none": what quantize applies
    eval: dict  # the held-out slice
    measured: float | None = None  # held-out perplexity of the final quantized model
    # the larger verification slice: windows, seq_len, tokens, baseline, measured, delta_pct
    verify: dict | None = None
    seconds: dict = field(default_factory=dict)
    # what units were measured by: "kl" (mean KL against the unquantized model, nats per token:
    # predicted perplexity ratio exp(sum)) or "ppl" (perplexity deltas, summed)
    metric: str = "ppl"
    budget_metric: float | None = None  # the budget in the metric's units (kl: log(1 + b/ppl))
    predicted_metric: float | None = None  # the decisions' summed metric
    # kl: the final model's mean KL against the unquantized one on the selection slice (how
    # far the per-unit KLs add up: compare with predicted_metric)
    measured_metric: float | None = None

    @property
    def measured_delta(self) -> float | None:
        return None if self.measured is None else self.measured - self.baseline

    def counts(self) -> dict[str, int]:
        """Modules per rung."""
        out = {r["name"]: 0 for r in self.rungs}
        for u in self.units:
            out[u.rung] += len(u.modules)
        return out

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(measured_delta=self.measured_delta, modules_per_rung=self.counts(),
                    predicted_pct=100 * self.predicted / self.baseline,
                    measured_delta_pct=None if self.measured is None else
                    100 * self.measured_delta / self.baseline,
                    headline=self.headline())
        return data

    def headline(self) -> dict:
        """Predicted against measured where the measurement is honest: on the verification
        slice (held-out documents the choices were not made on) when there is one, else on the
        selection slice (optimistic: a choice made on noisy deltas looks best on the tokens
        that chose it)."""
        pct = 100 * self.predicted / self.baseline
        if self.verify:
            return {"slice": "verify", "predicted_pct": pct,
                    "measured_pct": self.verify["delta_pct"], "tokens": self.verify["tokens"],
                    "disjoint": bool(self.verify.get("disjoint"))}
        return {"slice": "selection", "predicted_pct": pct,
                "measured_pct": None if self.measured is None else
                100 * self.measured_delta / self.baseline, "tokens": self.eval["tokens"]}

    def recipe(self, recipe: Recipe) -> Recipe:
        """``recipe`` with the decisions as overrides (ahead of the recipe's own: the first
        matching glob wins)."""
        return recipe.replace(overrides={**self.overrides, **recipe.overrides})


def check_target_recipe(recipe: Recipe) -> None:
    if recipe.smoothquant is not None or recipe.bn_retune or recipe.quantize_attention or \
            recipe.quantize_residual or recipe.rotate is not None:
        raise UsageError("--target-delta works per GEMM; it does not combine with --smoothquant, "
                         "--rotate, --bn-retune, --quantize-attention or --quantize-residual")


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise UsageError(f"--target-metric must be one of {', '.join(METRICS)}, got {metric!r}")


def metric_budget(metric: str, budget: float, baseline: float) -> float:
    """The perplexity budget in the metric's units: KL sums to the log of the perplexity
    ratio, so a delta ``budget`` is ``log(1 + budget / baseline)`` nats per token."""
    return math.log1p(budget / baseline) if metric == "kl" else budget


def predicted_delta(metric: str, total: float, baseline: float) -> float:
    """The perplexity delta a summed metric predicts (kl: baseline x (exp(sum) - 1))."""
    return baseline * math.expm1(total) if metric == "kl" else total


def choose(model: nn.Module, recipe: Recipe, batches: list, eval_ids: torch.Tensor, *,
           target: str = "1%", fallback: str = "bf16", level: str = "module",
           eval_batch_size: int = 4, progress=None, spill_dir=None,
           metric: str = "kl") -> TargetResult:
    """Measure every unit on every rung and assign rungs to meet ``target`` (a perplexity
    delta, ``"1%"`` relative or ``"0.5"`` absolute) on ``eval_ids`` [windows, seq_len]. The
    model is left unquantized; apply ``result.recipe(recipe)`` and quantize. GPTQ's Hessians
    (when a rung needs them) wait on disk, under ``spill_dir``, between the calibration pass
    and the sweeps, which read one unit's at a time. ``metric``: a unit's sensitivity as its
    perplexity delta ("ppl", summed) or its mean KL against the unquantized model ("kl",
    ``KLProbe``: non-negative per token, so small effects do not drown in signed noise)."""
    check_target_recipe(recipe)
    check_metric(metric)
    parse_target(target)
    if level not in LEVELS:
        raise UsageError(f"--target-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if not batches:
        raise UsageError("--target-delta needs calibration data (--calib-data)")
    rungs = ladder(recipe, fallback)
    times, t0 = {}, time.perf_counter()
    targets, _ = plan_targets(model, recipe)
    if not targets:
        raise UsageError("no GEMM module left to quantize (check --skip / --override)")
    needs_h = any(calibrators.weight_entry(r.recipe(recipe).weight_calib).reads_data
                  for r in rungs if not r.skip)
    session = Session(model, recipe, batches, targets, level, progress, hessians=needs_h)
    try:
        if session.hessians is not None:
            session.hessians.offload(spill_dir)
        times["calibrate"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        probe = (KLProbe if metric == "kl" else PerplexityProbe)(
            model, eval_ids, eval_batch_size, session.stack)
        baseline = probe.baseline()
        times["baseline"] = time.perf_counter() - t0
        deltas: dict[str, dict[str, float]] = {u.name: {} for u in session.units}
        ppl: dict[str, dict[str, float]] = {u.name: {} for u in session.units}
        for rung in rungs:
            t0 = time.perf_counter()
            if rung.skip:
                for u in session.units:
                    deltas[u.name][rung.name] = ppl[u.name][rung.name] = 0.0
                continue
            session.plan(rung.name, rung.recipe(recipe))
            session.probe_ppl.clear()
            for name, m in session.sweep(rung.name, probe, metric, baseline).items():
                deltas[name][rung.name] = m.delta
                side = session.probe_ppl.get(name)
                ppl[name][rung.name] = m.delta if metric == "ppl" else \
                    (0.0 if side is None else side - baseline)
            times[f"sweep {rung.name}"] = time.perf_counter() - t0
        budget = target_value(target, "ppl", baseline)
        choice = assign(deltas, rungs, metric_budget(metric, budget, baseline))
        by_name = {r.name: r for r in rungs}
        units = [UnitDecision(u.name, u.pattern, list(u.modules), choice[u.name], deltas[u.name],
                              ppl[u.name]) for u in session.units]
        overrides = {u.pattern: by_name[u.rung].override() for u in units if u.rung != "base"}
        total = sum(max(u.deltas[u.rung], 0.0) for u in units)
        total_base = sum(max(u.deltas["base"], 0.0) for u in units)
        replay = probe.cache is not None
        probe.cache = None  # the replayed layer outputs: not needed past the sweep
        result = TargetResult(
            target=target, budget=budget, baseline=baseline,
            predicted=predicted_delta(metric, total, baseline),
            predicted_base=predicted_delta(metric, total_base, baseline), level=level,
            rungs=[asdict(r) for r in rungs], units=units, overrides=overrides,
            eval={"windows": int(eval_ids.shape[0]), "seq_len": int(eval_ids.shape[1]),
                  "tokens": int(eval_ids.numel()), "replay": replay},
            seconds=times, metric=metric,
            budget_metric=metric_budget(metric, budget, baseline), predicted_metric=total)
        # not a field (not serialized): ``measure`` scores the final model's KL against the
        # reference distributions it recorded
        result.probe = probe if metric == "kl" else None
        return result
    finally:
        if session.hessians is not None:
            session.hessians.release()  # and the files offload wrote


def measure(model: nn.Module, eval_ids: torch.Tensor, result: TargetResult,
            eval_batch_size: int = 4) -> TargetResult:
    """The quantized ``model``'s perplexity on the held-out slice, into ``result``."""
    t0 = time.perf_counter()
    probe = getattr(result, "probe", None)
    if isinstance(probe, KLProbe):  # the same windows: KL and perplexity from one pass
        result.measured_metric = probe()
        result.measured = probe.last_ppl
    else:
        result.measured = perplexity(model, eval_ids, eval_batch_size)
    result.seconds["verify"] = time.perf_counter() - t0
    return result


def perplexity(model: nn.Module, eval_ids: torch.Tensor, eval_batch_size: int = 4) -> float:
    """Perplexity of ``model`` on the token windows ``eval_ids`` [windows, seq_len]."""
    return PerplexityProbe(model, eval_ids, eval_batch_size)()


def verify(model: nn.Module, verify_ids: torch.Tensor, baseline: float, result: TargetResult,
           eval_batch_size: int = 4) -> TargetResult:
    """The quantized ``model`` on the larger verification slice (``baseline``: the unquantized
    model's perplexity there), into ``result.verify``."""
    t0 = time.perf_counter()
    measured = perplexity(model, verify_ids, eval_batch_size)
    result.verify = {"windows": int(verify_ids.shape[0]), "seq_len": int(verify_ids.shape[1]),
                     "tokens": int(verify_ids.numel()), "baseline": baseline,
                     "measured": measured, "delta_pct": 100 * (measured - baseline) / baseline}
    result.seconds["verify slice"] = time.perf_counter() - t0
    return result


def split_heldout(texts: list[str], every: int = HELDOUT_EVERY) -> tuple[list[str], list[str]]:
    """(calibration documents, held-out documents): every ``every``-th document is held out,
    so the slice that checks the target is never calibrated on."""
    if len(texts) < 2:
        raise UsageError("--target-delta needs at least 2 calibration documents (one is held "
                         "out), or --target-data")
    every = min(every, len(texts))
    held = [t for i, t in enumerate(texts) if i % every == every - 1]
    return [t for i, t in enumerate(texts) if i % every != every - 1], held


__all__ = ["Rung", "ladder", "assign", "choose", "METRICS", "check_metric", "metric_budget",
           "predicted_delta", "measure", "perplexity", "verify",
           "split_heldout", "TargetResult",
           "UnitDecision", "HIGH_PRECISION"]
