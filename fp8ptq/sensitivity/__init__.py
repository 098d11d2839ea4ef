"""Per-module sensitivity: which GEMMs hurt the model most when they alone are quantized.

One calibration pass (``fp8ptq.steps.calibrate.collect_stats``, the statistics ``quantize``
uses) records every GEMM's input histogram and a few sampled input rows. Then, per format, each
*unit* -- one GEMM (level "module") or all GEMMs of one decoder layer (level "block") -- is
swapped for the ``QuantGemm`` that ``quantize`` would build from those statistics, measured, and
swapped back.
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

The package: ``units`` (grouping GEMMs into units), ``statistics`` (weight / input summaries,
per-format facts), ``swap`` (a unit quantized as ``quantize`` would, and back), ``suggest``
(the greedy suggestion and its ``quantize`` flags), ``run`` (``analyze``), ``report`` (the
result, its JSON and plot), ``budget`` (``--target-delta``) and ``probes``. What builds on the
execution folder sits there, above this one: ``fp8ptq.execution.sensitivity_stream``
(``analyze_streamed``: ``--metric sqnr`` block by block, for models that do not fit in memory,
on ``fp8ptq.execution.streaming``) and ``fp8ptq.execution.sensitivity_job``
(``run_sensitivity``: what ``fp8ptq sensitivity`` runs, the choice between in memory and
streamed included).
"""

from ..errors import UsageError
from .report import DEFINITIONS, SCHEMA, Measure, SensitivityResult, UnitResult, plot
from .run import (
    DEFAULT_EVAL_DATA,
    DEFAULT_STAT_FORMATS,
    METRICS,
    UNSUPPORTED,
    Session,
    analyze,
    check_recipe,
    eval_windows,
)
from .statistics import FormatStats, ModuleStats, TensorSummary, summarize_input, summarize_weight
from .suggest import NOT_SUGGESTED, Suggestion, parse_target, quantize_flags, suggest, target_value
from .swap import (
    FormatPlan,
    Swap,
    format_plan,
    format_recipe,
    format_stats,
    output_sqnr_db,
    plan_format,
    swapped,
)
from .units import LEVELS, Unit, group_units, layer_stack

__all__ = ["Session", "analyze", "check_recipe", "eval_windows", "plot", "group_units",
           "layer_stack",
           "summarize_input", "summarize_weight", "format_plan", "format_recipe", "format_stats",
           "plan_format",
           "output_sqnr_db", "swapped", "parse_target", "target_value", "suggest",
           "quantize_flags", "SensitivityResult", "UnitResult", "Measure", "Suggestion", "Unit",
           "TensorSummary", "FormatStats", "ModuleStats", "FormatPlan", "Swap", "SCHEMA",
           "DEFINITIONS", "METRICS", "LEVELS", "DEFAULT_STAT_FORMATS", "DEFAULT_EVAL_DATA",
           "UNSUPPORTED", "NOT_SUGGESTED", "UsageError"]
