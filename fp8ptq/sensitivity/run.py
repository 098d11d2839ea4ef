"""Running the analysis: one calibration pass, then per format every unit swapped in alone and
measured (perplexity of a short slice, or output SQNR), the greedy suggestion, and check runs
with every unit / the suggestion applied."""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from ..config.plan import SAMPLE_BATCHES, QuantPlan
from ..config.recipe import Recipe
from ..errors import DataError, UsageError
from ..formats import get_format
from ..io.data import build_calibration_set
from ..model.gemm import kind, weight_2d
from ..observe.hessian import HessianCollector
from ..steps.calibrate import collect_stats, plan_targets
from .probes import LogitsProbe, PerplexityProbe
from .report import Measure, SensitivityResult, UnitResult
from .statistics import FormatStats, ModuleStats, _db, _nsr, summarize_input, summarize_weight
from .suggest import _cost, _unnan, parse_target, suggest, target_value
from .swap import FormatPlan, format_plan, format_recipe, format_stats, swapped
from .units import Unit, group_units, layer_stack

METRICS = ("ppl", "sqnr")
DEFAULT_STAT_FORMATS = ("e4m3", "e5m2", "hif8", "int8")
DEFAULT_EVAL_DATA = "wikitext:wikitext-2-raw-v1:test"
# Recipe stages that change the model beyond swapping one GEMM: not meaningful per unit.
UNSUPPORTED = {"smoothquant": "--smoothquant", "bn_retune": "--bn-retune",
               "quantize_attention": "--quantize-attention",
               "quantize_residual": "--quantize-residual"}


def eval_windows(texts: list[str], tokenizer, *, tokens: int, seq_len: int, seed: int = 0,
                 source: str = "", windows: str = "random"):
    """``tokens // seq_len`` seeded windows (a ``CalibrationSet``) for the perplexity proxy;
    ``windows`` as in ``build_calibration_set``."""
    if tokens < 2 or seq_len < 2:
        raise UsageError(f"--eval-tokens and --eval-seq-len must be >= 2 (got {tokens}, "
                         f"{seq_len})")
    seq_len = min(seq_len, tokens)
    return build_calibration_set(texts, tokenizer, num_samples=tokens // seq_len,
                                 seq_len=seq_len, seed=seed, source=source, windows=windows)


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
        self.hessians = HessianCollector({t.name: t.module for t in targets},
                                         dtype=recipe.hessian_dtype_on("cpu")) \
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
        # per unit, the perplexity a probe that also scores it (``KLProbe.last_ppl``) measured
        # in the latest sweep
        self.probe_ppl: dict[str, float] = {}

    def plan(self, fmt: str, recipe: Recipe | None = None,
             part: QuantPlan | None = None) -> FormatPlan:
        """The plan of format ``fmt`` over the session's recipe, or (``recipe`` given) of that
        recipe, cached under the name ``fmt``; ``part``: that plan made already (a streamed
        analysis: one block's part of the whole model's plan)."""
        if fmt not in self._plans:
            self._plans[fmt] = format_plan(self.model, recipe or self.recipe,
                                           None if recipe is not None else fmt, self.collector,
                                           self.batches, plan=part)
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
            if value is not None and getattr(probe, "last_ppl", None) is not None:
                self.probe_ppl[u.name] = probe.last_ppl
            for s, st in zip(swaps, stats):
                self.modules[s.name].formats[fmt] = st
            if metric is not None:
                measures[u.name] = unit_measure(metric, value, baseline, stats)
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


def unit_measure(metric: str, value, baseline, stats: list[FormatStats]) -> Measure:
    if metric == "kl":  # a KLProbe's mean KL against the unquantized model: its own delta
        return Measure(0.0, 0.0) if value is None else Measure(value, value)
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
    formats, stat_formats = check_request(recipe, target, formats, stat_formats)
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

    ranked = rank(results.values(), primary)
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
    suggestion = suggest_for(ranked, primary, target, metric, baseline, scale)
    if verify:
        kept = {u.name: suggestion.overrides.get(u.pattern, primary) for u in ranked
                if u.pattern not in suggestion.skip}
        checks["suggested"] = session.check(probe, kept, baseline)
        times["checks"] = time.perf_counter() - t0
    times["total"] = time.perf_counter() - t_start
    note = (f"proxy: perplexity of {eval_facts['tokens']} tokens ({eval_facts['windows']} x "
            f"{eval_facts['seq_len']}) via model(input_ids, labels=input_ids); rank with it, "
            "report with `fp8ptq eval`" if metric == "ppl" else SQNR_NOTE)
    modules = list(session.modules.values())
    return SensitivityResult(level, metric, note, formats, stat_formats, baseline, ranked,
                             modules, suggestion, checks, eval_facts, times,
                             with_module_warnings(warnings, modules))


SQNR_NOTE = ("proxy: SQNR of each GEMM's output on sampled calibration rows; delta = output "
             "noise / signal power")


def check_request(recipe: Recipe, target: str, formats, stat_formats
                  ) -> tuple[list[str], list[str]]:
    """The recipe, target and formats checked before the long work: (measured formats, the
    formats whose statistics are reported, the measured ones first)."""
    check_recipe(recipe)
    parse_target(target)
    formats = list(dict.fromkeys(get_format(f).name for f in formats))
    if not formats:
        raise UsageError("no format to measure (--format)")
    return formats, list(dict.fromkeys([*formats, *(get_format(f).name for f in stat_formats)]))


def rank(results, primary: str) -> list[UnitResult]:
    """Most sensitive unit first (the primary format's delta)."""
    return sorted(results, key=lambda r: -_unnan(r.results[primary].delta))


def suggest_for(ranked: list[UnitResult], primary: str, target: str, metric: str, baseline,
                scale: float = 1.0):
    suggestion = suggest({r.name: {f: m.delta * scale for f, m in r.results.items()}
                          for r in ranked}, {r.name: r.pattern for r in ranked}, primary,
                         target, target_value(target, metric, baseline))
    suggestion.delta_scale = scale
    return suggestion


def with_module_warnings(warnings: list[str], modules: list[ModuleStats]) -> list[str]:
    return list(dict.fromkeys([*warnings, *(f"{m.name} ({fmt}): {w}" for m in modules
                                            for fmt, st in m.formats.items()
                                            for w in st.warnings)]))
