"""Per-module sensitivity: which GEMMs hurt the model most when they alone are quantized.

One calibration pass (``pipeline.collect_stats``, the statistics ``quantize`` uses) records every
GEMM's input histogram and a few sampled input rows. Then, per format, each *unit* -- one GEMM
(level "module") or all GEMMs of one decoder layer (level "block") -- is swapped for the
``QuantGemm`` that ``quantize`` would build from those statistics, measured, and swapped back.
Nothing is reloaded.

Metrics (both are proxies for ranking; ``fp8ptq eval`` gives the real numbers):

* ``ppl``: perplexity of a short slice of token windows, ``model(input_ids, labels=input_ids)``.
  The decoder layers before a unit are replayed from their outputs cached in the baseline pass
  (checked once to reproduce the baseline loss exactly; otherwise every run is a full pass).
* ``sqnr``: SQNR of each GEMM's output on the sampled calibration rows, no model pass per unit.
  A unit's delta is its output noise-to-signal power ratio (NSR), summed over its GEMMs.

Statistics. Weights exactly; inputs from the calibration histogram's bin centres (relative bin
width 1/32, so the moments are within about 0.1%):

* ``rms`` = sqrt(E[x^2]); ``outlier_ratio`` = amax / rms (crest factor: about 4-5 for 1e5
  Gaussian values, large when a few values set the range the scale must cover);
* ``kurtosis`` = E[x^4] / E[x^2]^2 about zero (3 for a zero-mean Gaussian; about zero because a
  symmetric quantizer sees magnitudes);
* ``channel_ratio`` (inputs) = largest / median per-channel amax (outlier channels).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .atomic import write_file
from .calibrators.layerwise import choose_layerwise
from .checkpoint.jsonsafe import json_safe
from .data import build_calibration_set
from .errors import DataError, UsageError
from .formats import get_format
from .hessian import HessianCollector
from .lm_probes import LogitsProbe, PerplexityProbe
from .model.gemm import kind, set_submodule, weight_2d
from .observers import bin_centers
from .pipeline import collect_stats, plan_targets, quantize_target, target_granularity
from .plan import SAMPLE_BATCHES, build_plan, reads_data
from .recipe import Recipe
from .scales import sqnr_db

SCHEMA = "fp8ptq.sensitivity/1"
METRICS = ("ppl", "sqnr")
LEVELS = ("module", "block")
DEFAULT_STAT_FORMATS = ("e4m3", "e5m2", "hif8", "int8")
DEFAULT_EVAL_DATA = "wikitext:wikitext-2-raw-v1:test"
# Recipe stages that change the model beyond swapping one GEMM: not meaningful per unit.
UNSUPPORTED = {"smoothquant": "--smoothquant", "bn_retune": "--bn-retune",
               "quantize_attention": "--quantize-attention",
               "quantize_residual": "--quantize-residual"}
# The calibration-size flags describe this run's (small) slice; quantize keeps its own defaults.
NOT_SUGGESTED = ("format", "weight_format", "act_format", "skip", "overrides", "num_samples",
                 "seq_len", "batch_size", "seed")
DEFINITIONS = {
    "rms": "sqrt(E[x^2])",
    "outlier_ratio": "amax / rms (crest factor)",
    "kurtosis": "E[x^4] / E[x^2]^2 about zero (3 for a zero-mean Gaussian)",
    "channel_ratio": "largest / median per-input-channel amax (inputs only)",
    "output_sqnr_db": "SQNR of the GEMM output on sampled calibration input rows, quantized "
                      "input x quantized weight vs high precision (convolutions: weight and "
                      "input noise-to-signal ratios added)",
    "delta": "ppl: perplexity(unit quantized) - baseline perplexity; sqnr: output noise / signal "
             "power of the unit (sum over its GEMMs)",
    "estimated_delta": "sum of the per-unit deltas of the units left quantized (negative "
                       "deltas count as 0), times delta_scale",
    "delta_scale": "ppl: 1; sqnr: measured logits NSR / sum of unit NSRs with every unit "
                   "quantized (1 without the check runs), so that the sqnr estimates and "
                   "--target-delta are about the logits' noise-to-signal ratio",
}


# ---------------------------------------------------------------------------------------------
# units


@dataclass
class Unit:
    name: str
    modules: list[str]
    pattern: str  # the --skip / --override glob that selects exactly this unit
    layer: int | None = None  # index in the decoder-layer stack; None: outside it


_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _block(name: str) -> tuple[str, str, int] | None:
    """``model.layers.3.mlp.up_proj`` -> (``model.layers.3``, ``model.layers``, 3)."""
    m = _INDEX.search(name)
    if m is None:
        return None
    return name[:m.end()], name[:m.start(1)].rstrip("."), int(m.group(1))


def layer_stack(model: nn.Module, names: list[str]) -> str | None:
    """The ``nn.ModuleList`` holding most of ``names``: the decoder layers."""
    counts = Counter(b[1] for b in map(_block, names) if b is not None)
    for parent, _ in counts.most_common():
        if isinstance(model.get_submodule(parent), nn.ModuleList):
            return parent
    return None


def group_units(model: nn.Module, names: list[str], level: str) -> list[Unit]:
    if level not in LEVELS:
        raise UsageError(f"granularity level must be one of {', '.join(LEVELS)}, got {level!r}")
    stack = layer_stack(model, names)
    units: dict[str, Unit] = {}
    for name in names:
        block = _block(name)
        layer = block[2] if block is not None and block[1] == stack else None
        if level == "block" and block is not None:
            key = block[0]
            unit = units.setdefault(key, Unit(key, [], f"{key}.*", layer))
            unit.modules.append(name)
        else:
            units[name] = Unit(name, [name], name, layer)
    return list(units.values())


# ---------------------------------------------------------------------------------------------
# statistics


@dataclass
class TensorSummary:
    amax: float
    rms: float
    outlier_ratio: float
    kurtosis: float
    channel_ratio: float | None = None
    count: int = 0


@dataclass
class FormatStats:
    weight_scale_min: float
    weight_scale_max: float
    weight_sqnr_db: float
    input_scale: float | None
    input_sqnr_db: float | None
    output_sqnr_db: float | None
    act_calib: str | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class ModuleStats:
    name: str
    kind: str
    unit: str
    weight: TensorSummary
    input: TensorSummary | None
    formats: dict[str, FormatStats] = field(default_factory=dict)


def _summary(amax: float, m2: float, m4: float, count: int, channel_ratio=None) -> TensorSummary:
    rms = math.sqrt(m2)
    return TensorSummary(amax=amax, rms=rms, outlier_ratio=amax / rms if rms > 0 else math.nan,
                         kurtosis=m4 / (m2 * m2) if m2 > 0 else math.nan,
                         channel_ratio=channel_ratio, count=count)


def summarize_weight(w2d: torch.Tensor) -> TensorSummary:
    w = w2d.detach().double()
    m2 = float(w.pow(2).mean())
    return _summary(float(w.abs().max()), m2, float(w.pow(4).mean()), w.numel())


def summarize_input(stats) -> TensorSummary | None:
    """From a ``TensorStats`` histogram; None if the module saw no calibration tokens."""
    if stats is None or not stats.seen:
        return None
    counts = stats.histogram
    c = bin_centers().clamp(max=max(stats.amax, 0.0))
    total = float(counts.sum())
    m2 = float((c.pow(2) * counts).sum()) / total
    m4 = float((c.pow(4) * counts).sum()) / total
    ch = stats.channel_amax
    median = float(ch.median()) if ch is not None and ch.numel() else 0.0
    ratio = float(ch.max()) / median if median > 0 else None
    return _summary(stats.amax, m2, m4, stats.count, ratio)


def _nsr(db: float | None) -> float:
    """Noise-to-signal power ratio of an SQNR in dB: 0 for None (not quantized); an SQNR that
    could not be computed (NaN) counts as all noise."""
    if db is None:
        return 0.0
    return math.inf if math.isnan(db) else 10 ** (-db / 10)


def _db(nsr: float) -> float:
    if nsr <= 0:
        return math.inf
    return -10 * math.log10(nsr) if math.isfinite(nsr) else -math.inf


# ---------------------------------------------------------------------------------------------
# swapping one unit for QuantGemm modules and back


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


def format_plan(model, recipe: Recipe, fmt: str | None, collector, batches) -> FormatPlan:
    """The run's plan (``fp8ptq.plan``) for ``recipe`` in ``fmt`` (None: as ``recipe`` says),
    with its calibrators built and any layer-aware choice made once."""
    plan = build_plan(model, recipe if fmt is None else format_recipe(recipe, fmt))
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


# ---------------------------------------------------------------------------------------------
# suggestion


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
    default = Recipe()
    for name in Recipe.model_fields:
        value = getattr(recipe, name)
        if name in NOT_SUGGESTED or value == getattr(default, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, tuple):
            flags += [flag, ",".join(map(str, value))]
        else:
            flags += [flag, str(value)]
    for pattern in [*recipe.skip, *suggestion.skip]:
        flags += ["--skip", pattern]
    for pattern, fmt in {**recipe.overrides, **suggestion.overrides}.items():
        flags += ["--override", f"{pattern}={fmt}"]
    return flags


# ---------------------------------------------------------------------------------------------
# the analysis


@dataclass
class Measure:
    value: float  # ppl: perplexity; sqnr: output SQNR of the unit in dB
    delta: float


@dataclass
class UnitResult:
    name: str
    modules: list[str]
    pattern: str
    layer: int | None
    results: dict[str, Measure] = field(default_factory=dict)


@dataclass
class SensitivityResult:
    level: str
    metric: str
    note: str
    formats: list[str]  # measured with the metric; the first is the suggestion's base
    stat_formats: list[str]
    baseline: float | None
    units: list[UnitResult]  # most sensitive first (first format's delta)
    modules: list[ModuleStats]  # model order
    suggestion: Suggestion
    checks: dict  # measured: every unit quantized / the suggestion applied
    eval: dict
    seconds: dict
    warnings: list[str]

    def to_dict(self, **extra) -> dict:
        return json_safe({"schema": SCHEMA, **extra, **dataclasses.asdict(self),
                          "definitions": DEFINITIONS})


def eval_windows(texts: list[str], tokenizer, *, tokens: int, seq_len: int, seed: int = 0,
                 source: str = ""):
    """``tokens // seq_len`` seeded windows (a ``CalibrationSet``) for the perplexity proxy."""
    if tokens < 2 or seq_len < 2:
        raise UsageError(f"--eval-tokens and --eval-seq-len must be >= 2 (got {tokens}, "
                         f"{seq_len})")
    seq_len = min(seq_len, tokens)
    return build_calibration_set(texts, tokenizer, num_samples=tokens // seq_len,
                                 seq_len=seq_len, seed=seed, source=source)


def check_recipe(recipe: Recipe) -> None:
    used = [flag for key, flag in UNSUPPORTED.items() if getattr(recipe, key)]
    if used:
        raise UsageError(f"sensitivity does not support {', '.join(used)} (they change the "
                         "model beyond one GEMM); analyze without them")


def _ticker(progress, description: str, total: int):
    tick = progress(description, total) if progress is not None else None
    return tick or (lambda: None)


class Session:
    """State shared by the sweeps: the statistics of the one calibration pass (with GPTQ's
    Hessians when ``hessians``), the units, and one ``FormatPlan`` per format or recipe."""

    def __init__(self, model, recipe, batches, targets, level, progress, hessians: bool = False):
        self.model, self.recipe, self.batches, self.progress = model, recipe, batches, progress
        self.level = level
        self.hessians = HessianCollector({t.name: t.module for t in targets}) \
            if hessians else None
        self.collector = collect_stats(model, targets, batches,
                                       _ticker(progress, "calibrating", len(batches)),
                                       sample_batches=SAMPLE_BATCHES, hessians=self.hessians)
        self.rows = self.collector.row_samples()
        names = [t.name for t in targets]
        self.units = group_units(model, names, level)
        stack = layer_stack(model, names)
        self.stack = model.get_submodule(stack) if stack else None
        unit_of = {n: u.name for u in self.units for n in u.modules}
        self.modules = {t.name: ModuleStats(t.name, kind(t.module), unit_of[t.name],
                                            summarize_weight(weight_2d(t.module)),
                                            summarize_input(self.collector.stats.get(t.name)))
                        for t in targets}
        self._plans: dict[str, FormatPlan] = {}

    def plan(self, fmt: str, recipe: Recipe | None = None) -> FormatPlan:
        """The plan of format ``fmt`` over the session's recipe, or (``recipe`` given) of that
        recipe, cached under the name ``fmt``."""
        if fmt not in self._plans:
            self._plans[fmt] = format_plan(self.model, recipe or self.recipe,
                                           None if recipe is not None else fmt, self.collector,
                                           self.batches)
        return self._plans[fmt]

    @contextmanager
    def quantized(self, unit: Unit, fmt: str):
        plan = self.plan(fmt)
        present = [n for n in unit.modules if n in plan.targets]
        with swapped(self.model, plan, present, self.collector.stats, self.hessians) as swaps:
            yield swaps

    def sweep(self, fmt: str, probe, metric: str | None, baseline) -> dict[str, Measure]:
        """Each unit alone in ``fmt``: module statistics, and with ``metric`` its measure."""
        measures = {}
        what = "perplexity" if probe is not None else "statistics"
        tick = _ticker(self.progress, f"{fmt}: {what} per {self.level}", len(self.units))
        for u in self.units:
            with self.quantized(u, fmt) as swaps:
                stats = [format_stats(s, self.rows.get(s.name)) for s in swaps]
                value = probe(u.layer) if probe is not None and swaps else None
            for s, st in zip(swaps, stats):
                self.modules[s.name].formats[fmt] = st
            if metric is not None:
                measures[u.name] = _measure(metric, value, baseline, stats)
            tick()
        return measures

    def check(self, probe, choice: dict[str, str], baseline) -> dict:
        """Measure the model with every unit named in ``choice`` quantized in its format."""
        chosen = [u for u in self.units if u.name in choice]
        for fmt in set(choice.values()):  # plans calibrate on the unquantized model
            self.plan(fmt)
        layers = [u.layer for u in chosen]
        first = None if not layers or None in layers else min(layers)
        with ExitStack() as stack:
            for u in chosen:
                stack.enter_context(self.quantized(u, choice[u.name]))
            value = probe(first) if chosen else baseline if probe.metric == "ppl" else math.inf
        if probe.metric == "ppl":
            return {"perplexity": value, "delta": value - baseline}
        return {"logits_sqnr_db": value, "nsr": _nsr(value)}


def _measure(metric: str, value, baseline, stats: list[FormatStats]) -> Measure:
    if metric == "ppl":
        if value is None:
            return Measure(baseline, 0.0)
        return Measure(value, value - baseline if math.isfinite(value) else math.inf)
    nsr = sum(_nsr(s.output_sqnr_db) for s in stats)
    return Measure(_db(nsr), nsr)


def analyze(model: nn.Module, recipe: Recipe, batches: list, *, formats=("e4m3",),
            stat_formats=DEFAULT_STAT_FORMATS, level: str = "module", metric: str = "ppl",
            eval_ids: torch.Tensor | None = None, eval_batch_size: int = 4,
            target: str = "1%", verify: bool = True, progress=None) -> SensitivityResult:
    """Sensitivity of every GEMM ``recipe`` would quantize. ``batches``: calibration batches;
    ``eval_ids`` [windows, seq_len]: the perplexity slice (metric "ppl"). ``progress(description,
    total)`` may return a per-step callback. The model is left as it was."""
    if metric not in METRICS:
        raise UsageError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if metric == "ppl" and eval_ids is None:
        raise UsageError("metric ppl needs evaluation token windows (--eval-data)")
    if not batches:
        raise DataError("sensitivity needs calibration data")
    check_recipe(recipe)
    parse_target(target)  # a bad target fails before the long work
    formats = list(dict.fromkeys(get_format(f).name for f in formats))
    if not formats:
        raise UsageError("no format to measure (--format)")
    stat_formats = list(dict.fromkeys([*formats, *(get_format(f).name for f in stat_formats)]))
    primary = formats[0]
    targets, _ = plan_targets(model, format_recipe(recipe, primary))
    if not targets:
        raise UsageError("no GEMM module left to analyze (check --skip / --override)")

    times, t_start = {}, time.perf_counter()
    session = Session(model, recipe, batches, targets, level, progress)
    times["calibrate"] = time.perf_counter() - t_start
    t0 = time.perf_counter()
    probe, baseline, eval_facts, warnings = None, None, {}, []
    if metric == "ppl":
        probe = PerplexityProbe(model, eval_ids, eval_batch_size, session.stack)
        baseline = probe.baseline()
        warnings += probe.notes
        eval_facts = {"windows": int(eval_ids.shape[0]), "seq_len": int(eval_ids.shape[1]),
                      "tokens": int(eval_ids.numel()), "replay": probe.cache is not None}
    times["baseline"] = time.perf_counter() - t0

    results = {u.name: UnitResult(u.name, u.modules, u.pattern, u.layer) for u in session.units}
    for fmt in stat_formats:
        t0 = time.perf_counter()
        measured = fmt in formats
        per_unit = session.sweep(fmt, probe if measured else None,
                                 metric if measured else None, baseline)
        for name, m in per_unit.items():
            results[name].results[fmt] = m
        times[f"format {fmt}"] = time.perf_counter() - t0

    ranked = sorted(results.values(), key=lambda r: -_unnan(r.results[primary].delta))
    t0 = time.perf_counter()
    checks, scale = {}, 1.0
    if verify:
        if probe is None:
            ids = batches[0]["input_ids"] if isinstance(batches[0], dict) else batches[0]
            probe = LogitsProbe(model, ids[:2])
            probe.baseline()
        checks["all_quantized"] = session.check(probe, {u.name: primary for u in ranked},
                                                baseline)
        total = sum(_cost(r.results[primary].delta) for r in ranked)
        if metric == "sqnr" and total > 0:
            scale = checks["all_quantized"]["nsr"] / total
    suggestion = suggest({r.name: {f: m.delta * scale for f, m in r.results.items()}
                          for r in ranked}, {r.name: r.pattern for r in ranked}, primary,
                         target, target_value(target, metric, baseline))
    suggestion.delta_scale = scale
    if verify:
        kept = {u.name: suggestion.overrides.get(u.pattern, primary) for u in ranked
                if u.pattern not in suggestion.skip}
        checks["suggested"] = session.check(probe, kept, baseline)
        times["checks"] = time.perf_counter() - t0
    times["total"] = time.perf_counter() - t_start
    note = (f"proxy: perplexity of {eval_facts['tokens']} tokens ({eval_facts['windows']} x "
            f"{eval_facts['seq_len']}) via model(input_ids, labels=input_ids); rank with it, "
            "report with `fp8ptq eval`" if metric == "ppl" else
            "proxy: SQNR of each GEMM's output on sampled calibration rows; delta = output noise "
            "/ signal power")
    modules = list(session.modules.values())
    warnings += [f"{m.name} ({fmt}): {w}" for m in modules for fmt, st in m.formats.items()
                 for w in st.warnings]
    return SensitivityResult(level, metric, note, formats, stat_formats, baseline, ranked,
                             modules, suggestion, checks, eval_facts, times,
                             list(dict.fromkeys(warnings)))


# ---------------------------------------------------------------------------------------------
# files


def plot(result: SensitivityResult, path: str | Path, max_bars: int = 40) -> Path:
    """PNG: heatmap of weight / input / output SQNR per module x format, and the sensitivity
    ranking."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    mods = result.modules
    cols = [(f, part) for f in result.stat_formats for part in ("weight", "input", "output")]
    grid = np.array([[_finite(getattr(m.formats.get(f), f"{part}_sqnr_db", None))
                      for f, part in cols] for m in mods], dtype=float)
    ranked = result.units[:max_bars]
    primary = result.formats[0]
    height = max(4.0, 0.13 * len(mods) + 1.5)
    fig, (ax_map, ax_bar) = plt.subplots(1, 2, figsize=(13, height),
                                         gridspec_kw={"width_ratios": [1, 1.3]})
    image = ax_map.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis")
    ax_map.set_xticks(range(len(cols)), [f"{f} {p[0].upper()}" for f, p in cols], rotation=45,
                      ha="right", fontsize=7)
    ax_map.set_yticks(range(len(mods)), [m.name for m in mods], fontsize=5 if len(mods) > 40
                      else 7)
    ax_map.set_title("SQNR (dB): W weight, I input, O output")
    fig.colorbar(image, ax=ax_map, fraction=0.05, pad=0.02)
    deltas = [_finite(r.results[primary].delta) for r in ranked]
    scale, unit = (100.0 / result.baseline, "% of baseline ppl") if result.metric == "ppl" \
        else (100.0, "% output noise / signal")
    ax_bar.barh(range(len(ranked)), [d * scale for d in deltas],
                color=["tab:red" if d > 0 else "tab:gray" for d in deltas])
    ax_bar.set_yticks(range(len(ranked)), [r.name for r in ranked], fontsize=6)
    ax_bar.invert_yaxis()
    ax_bar.set_xlabel(f"delta when quantized alone in {primary} ({unit})")
    ax_bar.set_title(f"sensitivity ranking ({result.level}, top {len(ranked)})")
    fig.tight_layout()
    try:
        write_file(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return Path(path)


def _finite(v):
    return float(v) if v is not None and math.isfinite(v) else math.nan
