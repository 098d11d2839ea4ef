"""Comparing variants of one model: deltas to the baseline, table, markdown, JSON, plot, CI gates.

A variant is ``{"name": str, "metrics": {"task.metric": float}, "seconds": float, "recipe": dict}``;
the first variant is the baseline.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

from rich.table import Table

from fp8ptq.errors import UsageError
from fp8ptq.numbers import finite_or_none, fmt_num

from .stats import paired_interval

SCHEMA_VERSION = 1

_LOWER_IS_BETTER = ("perplexity", "bits_per_byte", "bpb", "loss", "error")
_HIGHER_IS_BETTER = ("exact_match", "f1", "acc", "mcc", "bleu", "rouge", "pass@")

_number = partial(fmt_num, spec="{:.4g}", nan="nan")  # metric values in tables and gates


def higher_is_better(metric: str) -> bool:
    """Direction of ``metric`` ("task.metric" or bare), from its name."""
    name = metric.rsplit(".", 1)[-1].lower()
    if any(word in name for word in _LOWER_IS_BETTER):
        return False
    if any(word in name for word in _HIGHER_IS_BETTER):
        return True
    raise UsageError(f"don't know whether higher or lower is better for metric {metric!r}")


def metric_names(variants: list[dict]) -> list[str]:
    """Every metric of any variant, in first-seen order."""
    return list(dict.fromkeys(name for v in variants for name in v["metrics"]))


def deltas(variants: list[dict]) -> list[dict[str, float]]:
    """Per variant, ``metric -> value - baseline value`` for the metrics the baseline has."""
    baseline = variants[0]["metrics"]
    return [
        {name: value - baseline[name] for name, value in v["metrics"].items() if name in baseline}
        for v in variants
    ]


def relative_deltas(variants: list[dict]) -> list[dict[str, float]]:
    """Like :func:`deltas`, as a fraction of the baseline value (nan where the baseline is 0)."""
    baseline = variants[0]["metrics"]
    return [
        {name: d / abs(baseline[name]) if baseline[name] else math.nan for name, d in row.items()}
        for row in deltas(variants)
    ]



def attach_intervals(variants: list[dict]) -> None:
    """``variant["intervals"][metric] = {"ci95": [lo, hi], "pct_ci95": [lo, hi]}``: paired
    bootstrap 95% intervals of each delta to the baseline, from the per-sample records the
    tasks returned (``variant["records"]``: task -> ``Records``)."""
    base = variants[0].get("records") or {}
    for variant in variants[1:]:
        out = {}
        for key in variant["metrics"]:
            task, _, metric = key.partition(".")
            b, o = base.get(task), (variant.get("records") or {}).get(task)
            if b is not None and o is not None and metric:
                interval = paired_interval(b, o, metric)
                if interval is not None:
                    out[key] = interval
        variant["intervals"] = out


def _delta_cell(value: float, delta: float, pct: float, interval: dict | None, mode: str) -> str:
    if mode == "abs":
        text = f"{delta:+.3g}"
        if interval:
            lo, hi = interval["ci95"]
            text += f", 95% CI {lo:+.3g}..{hi:+.3g}"
    else:
        text = f"{pct:+.1f}%" if math.isfinite(pct) else f"{delta:+.3g}"
        if interval and interval.get("pct_ci95") and math.isfinite(pct):
            lo, hi = interval["pct_ci95"]
            text += f", 95% CI {lo:+.1f}..{hi:+.1f}%"
    return f"{_number(value)} ({text})"


def _cells(variants: list[dict], mode: str = "pct") -> tuple[list[str], list[list[str]]]:
    """Header and rows shared by the rich table and the markdown: "21.43 (+1.7%, 95% CI
    +0.9..+2.4%)" (``mode`` "pct", the default) or "21.43 (+0.35, 95% CI ...)" ("abs")."""
    names = metric_names(variants)
    rows = []
    for i, (variant, delta, rel) in enumerate(zip(variants, deltas(variants),
                                                  relative_deltas(variants))):
        row = [variant["name"]]
        for name in names:
            if name not in variant["metrics"]:
                row.append("-")
            elif i == 0 or name not in delta:
                row.append(_number(variant["metrics"][name]))
            else:
                interval = (variant.get("intervals") or {}).get(name)
                row.append(_delta_cell(variant["metrics"][name], delta[name],
                                       100 * rel.get(name, math.nan), interval, mode))
        row.append(f"{variant.get('seconds', math.nan):.1f}")
        rows.append(row)
    return ["variant", *names, "seconds"], rows


def render_table(variants: list[dict], mode: str = "pct") -> Table:
    header, rows = _cells(variants, mode)
    title = "evaluation (delta to baseline)" + (" in %" if mode == "pct" else "") + \
        ("; 95% CI: paired bootstrap" if any(v.get("intervals") for v in variants) else "")
    table = Table(title=title)
    for i, column in enumerate(header):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def to_markdown(variants: list[dict], mode: str = "pct") -> str:
    header, rows = _cells(variants, mode)
    lines = [header, ["---", *["---:"] * (len(header) - 1)], *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"



def to_json(variants: list[dict], protocol: dict, recipe: dict | None = None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "protocol": protocol,
        "recipe": recipe,
        "variants": [
            {
                "name": variant["name"],
                "metrics": {k: finite_or_none(v) for k, v in variant["metrics"].items()},
                "deltas": {k: finite_or_none(v) for k, v in delta.items()},
                "deltas_pct": {k: finite_or_none(100 * v) for k, v in rel.items()},
                "deltas_ci95": {k: iv["ci95"] for k, iv in
                                (variant.get("intervals") or {}).items()},
                "deltas_pct_ci95": {k: iv["pct_ci95"] for k, iv in
                                    (variant.get("intervals") or {}).items()},
                "seconds": variant.get("seconds"),
                "recipe": variant.get("recipe"),
            }
            for variant, delta, rel in zip(variants, deltas(variants),
                                           relative_deltas(variants))
        ],
    }


def plot_deltas(variants: list[dict], path: str | Path) -> Path:
    """Bar chart (PNG) of each quantized variant's change vs the baseline, in percent per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = metric_names(variants[:1])
    quantized = list(zip(variants[1:], relative_deltas(variants)[1:]))
    width = 0.8 / max(len(quantized), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(names) + 2), 4))
    for k, (variant, rel) in enumerate(quantized):
        xs = [i + (k - (len(quantized) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [100 * rel.get(name, math.nan) for name in names], width, label=variant["name"])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)))
    arrows = {True: " (higher better)", False: " (lower better)"}
    labels = [name + arrows.get(_direction_or(name), "") for name in names]
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel("change vs baseline (%)")
    ax.set_title(f"vs {variants[0]['name']}")
    if quantized:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _direction_or(name: str) -> bool | None:
    try:
        return higher_is_better(name)
    except UsageError:
        return None


# --- CI gates -----------------------------------------------------------------------------------


def parse_gate(gate: str, known: list[str]) -> tuple[str, float, bool]:
    """``"METRIC=VALUE"`` / ``"METRIC=VALUE%"`` -> (metric key, allowed worsening, is_percent).

    METRIC is a "task.metric" key or a bare metric name that only one task has.
    """
    metric, sep, amount = gate.partition("=")
    metric, amount = metric.strip(), amount.strip()
    percent = amount.endswith("%")
    try:
        allowed = float(amount.removesuffix("%"))
    except ValueError:
        allowed = math.nan
    if not sep or not metric or not allowed >= 0:
        raise UsageError(f"bad gate {gate!r}: expected METRIC=VALUE or METRIC=VALUE% (VALUE >= 0)")
    matches = [k for k in known if k == metric] or [k for k in known if k.endswith("." + metric)]
    if len(matches) != 1:
        why = "is ambiguous" if matches else "is not among the evaluated metrics"
        raise UsageError(f"bad gate {gate!r}: metric {metric!r} {why} ({', '.join(known)})")
    higher_is_better(matches[0])  # a metric without a direction cannot gate
    return matches[0], allowed, percent


def check_gates(variants: list[dict], gates: list[str], gate_on: str = "point") -> list[str]:
    """One line per (quantized variant, gate) that got worse than the baseline by more than
    allowed. ``gate_on`` "ci-upper" judges the worse end of the delta's 95% interval instead of
    the point estimate (a variant passes only if it is within the limit with 95% confidence)."""
    baseline = variants[0]["metrics"]
    failures = []
    for gate in gates:
        metric, allowed, percent = parse_gate(gate, list(baseline))
        reference = baseline[metric]
        limit = allowed / 100 * abs(reference) if percent else allowed
        sign = -1.0 if higher_is_better(metric) else 1.0
        for variant in variants[1:]:
            value = variant["metrics"].get(metric, math.nan)
            worsening = sign * (value - reference)
            judged, how = worsening, ""
            interval = (variant.get("intervals") or {}).get(metric)
            if gate_on == "ci-upper":
                if interval is None:
                    how = "; no interval for this metric, point estimate used"
                else:
                    judged = max(sign * interval["ci95"][0], sign * interval["ci95"][1])
                    how = f"; worse end of the 95% CI {sign * judged:+.3g}"
            if not judged <= limit:  # nan fails too
                failures.append(
                    f"{variant['name']}: {metric} {_number(value)} vs baseline "
                    f"{_number(reference)} "
                    f"({value - reference:+.3g}{how}) exceeds gate {gate} (allowed {limit:.3g} "
                    "worse)"
                )
    return failures
