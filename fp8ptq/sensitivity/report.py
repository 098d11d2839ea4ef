"""What a sensitivity analysis returns (``SensitivityResult``, its JSON form with the
definitions of every statistic) and its plot."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..files.atomic import write_file
from ..numbers import finite_or_nan, json_safe
from .statistics import ModuleStats
from .suggest import Suggestion

SCHEMA = "fp8ptq.sensitivity/1"
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


def plot(result: SensitivityResult, path: str | Path, max_bars: int = 40) -> Path:
    """PNG: heatmap of weight / input / output SQNR per module x format, and the sensitivity
    ranking."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    mods = result.modules
    cols = [(f, part) for f in result.stat_formats for part in ("weight", "input", "output")]
    grid = np.array([[finite_or_nan(getattr(m.formats.get(f), f"{part}_sqnr_db", None))
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
    deltas = [finite_or_nan(r.results[primary].delta) for r in ranked]
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
