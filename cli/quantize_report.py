"""What ``fp8ptq quantize`` prints: the per-module table (fitted to the terminal), the experts,
what stayed in high precision, the ``--target-delta`` summary, sizes, path and the timing line.
It reads only the report dict that ``--json`` prints, so both say the same."""

from __future__ import annotations

import re
from collections import Counter
from functools import partial

from rich.console import Console
from rich.markup import escape

from fp8ptq.numbers import fmt_bytes, fmt_num, fmt_short
from fp8ptq.runtime.usage import time_line

from .tables import Column, fitted_table

_db = partial(fmt_num, spec="{:.1f}", nan="nan")  # SQNR columns


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    if report.get("scheme"):
        console.print(f"scheme {report['scheme']['name']}: {' '.join(report['scheme']['flags'])}"
                      " (explicit flags override it)", highlight=False)
    modules = report["modules"]
    names = [m["name"] for m in modules]
    title = f"quantized {len(modules)} modules"
    table, hidden = fitted_table(console, report_columns(modules, names), title=title)
    prefix, short = layer_prefix(names)
    if hidden and prefix:  # too narrow for full names: cut the layer-stack prefix instead
        title += f"; N.name = {prefix}N.name"
        table, hidden = fitted_table(console, report_columns(modules, short), title=title)
    if hidden:
        table.caption = f"not shown at this width: {', '.join(hidden)} (see --json)"
    console.print(table)
    for name, e in (report.get("experts") or {}).items():
        console.print(f"{name}: {e['num_experts']} experts x {len(e['projections'])} GEMMs, "
                      f"{e['weight_format']} weights / {e['act_format'] or 'none'} activations, "
                      f"input scales per expert ({e['act_calib']})", highlight=False)
    if report["skipped"]:
        console.print(f"kept in high precision: {', '.join(report['skipped'])}")
    hp = report.get("high_precision")
    if hp and hp["high_precision_parameters"]:
        top = ", ".join(f"{t['name']} ({t['parameters']:,})"
                        for t in hp["largest_high_precision"][:3])
        console.print(f"left in high precision: {100 * hp['high_precision_fraction']:.1f}% of "
                      f"parameters ({hp['high_precision_parameters']:,}; largest: {top})",
                      highlight=False)
    if report.get("smoothquant"):
        console.print(smoothquant_line(report["smoothquant"]), highlight=False)
    if report.get("target_delta"):
        for line in target_lines(report["target_delta"]):
            console.print(line, highlight=False)
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False)
    s = report["sizes"]
    if s.get("checkpoint_bytes") and s.get("original_bytes"):
        console.print(f"checkpoint {fmt_bytes(s['checkpoint_bytes'])} vs original "
                      f"{fmt_bytes(s['original_bytes'])} "
                      f"({s['checkpoint_bytes'] / s['original_bytes']:.2f}x)")
    if report.get("path"):
        console.print(f"path: {report['path']} ({report['path_reason']})", highlight=False)
    if report.get("predicted_gpu_mb") is not None or report.get("predicted_rss_mb") is not None:
        console.print(memory_line(report), highlight=False)
    # calibrate+quantize is the sum of the pipeline stages listed beside it
    stages = {k: v for k, v in report["seconds"].items() if k != "calibrate+quantize"}
    console.print(f"{time_line(stages, always=('load', 'write'))} -> {report['output']}")


def memory_line(report: dict) -> str:
    """``memory: GPU 5210 MiB measured / 5480 predicted, host ...``: the chosen path's
    predicted peaks beside the measured ones (budgets sized from the prediction)."""
    out = []
    for name, key in (("GPU", "gpu"), ("host", "rss")):
        predicted = report.get(f"predicted_{key}_mb")
        if predicted is None:
            continue
        measured = report.get(f"peak_{key}_mb")
        got = "-" if measured is None else f"{measured:.0f}"
        out.append(f"{name} {got} MiB measured / {predicted:.0f} predicted")
    return "memory: " + ", ".join(out)


def smoothquant_line(sq: dict) -> str:
    """SmoothQuant: alpha, where it folded, how many norm groups / GEMM pairs it smoothed."""
    done = {part: sum(e.get("alpha") is not None for e in (sq.get(part) or {}).values())
            for part in ("groups", "pairs")}
    pairs = sorted({re.sub(r"\.\d+\.", ".N.", k) for k, e in (sq.get("pairs") or {}).items()
                    if e.get("alpha") is not None})
    line = (f"smoothquant alpha {sq['alpha']} into {sq.get('into', 'norms')}: "
            f"{done['groups']} norm group(s), {done['pairs']} GEMM pair(s) smoothed")
    if pairs:
        line += f" ({'; '.join(pairs)})"
    if sq.get("skipped"):
        line += f"; {len(sq['skipped'])} skipped (fp8ptq.json extras.smoothquant)"
    return line


def target_lines(t: dict) -> list[str]:
    """The --target-delta summary: the rungs taken and predicted vs measured loss."""
    rungs = ", ".join(f"{n} {c}" for n, c in t["modules_per_rung"].items())
    measured = "-" if t["measured"] is None else (
        f"{t['measured']:.4g} ({t['measured_delta']:+.3g}, {t['measured_delta_pct']:+.2f}%)")
    lines = [f"target-delta {t['target']} (<= {t['budget']:.3g} perplexity on "
             f"{t['eval']['tokens']:,} held-out tokens; baseline {t['baseline']:.4g}): "
             f"modules per rung: {rungs}",
             f"  predicted {t['predicted']:+.3g} ({t['predicted_pct']:+.2f}%; all on the base "
             f"rung {t['predicted_base']:+.3g}), measured {measured}"]
    if t.get("metric") == "kl":
        kl = "-" if t.get("measured_metric") is None else f"{t['measured_metric']:.4g}"
        lines.append(f"  by KL against the unquantized model (nats/token): budget "
                     f"{t['budget_metric']:.4g}, summed per unit {t['predicted_metric']:.4g}, "
                     f"whole model {kl}")
    if t.get("verify"):
        v = t["verify"]
        where = "held-out documents not chosen on" if v.get("disjoint") else \
            "held-out tokens, overlapping the selection slice"
        lines.append(f"  verified on {v['tokens']:,} {where} ({v['windows']} x "
                     f"{v['seq_len']}): {v['baseline']:.4g} -> {v['measured']:.4g} "
                     f"({v['delta_pct']:+.2f}%; predicted {t['predicted_pct']:+.2f}%)")
    changed = [u for u in t["units"] if u["rung"] != "base"]
    for u in changed[:8]:
        lines.append(f"  {u['unit']}: {u['rung']} (alone: base {u['deltas']['base']:+.3g} -> "
                     f"{u['deltas'][u['rung']]:+.3g})")
    if len(changed) > 8:
        lines.append(f"  ... and {len(changed) - 8} more (fp8ptq.json extras.target_delta)")
    return lines


def report_columns(modules: list[dict], names: list[str]) -> list[Column]:
    def cells(f):
        return [f(m) for m in modules]

    def w_scale(m):
        lo, hi = m["weight_scale_min"], m["weight_scale_max"]
        return fmt_short(hi) if lo == hi else f"{fmt_short(lo, 2)}..{fmt_short(hi, 2)}"

    def a_scale(m):
        if m["act_format"] and m["input_scale"] is None:
            return "dynamic"
        return fmt_short(m["input_scale"])

    columns = [
        Column("module", names, "left"),
        Column("W fmt", cells(lambda m: m["weight_format"])),
        Column("W scale", cells(w_scale), drop=1),
        Column("W amax", cells(lambda m: fmt_short(m["weight_amax"])), drop=2),
        Column("W SQNR dB", cells(lambda m: _db(m["weight_sqnr_db"]))),
        Column("A fmt", cells(lambda m: m["act_format"] or "-")),
        Column("A scale", cells(a_scale)),
        Column("A amax", cells(lambda m: fmt_short(m["input_amax"])), drop=3),
        Column("A SQNR dB", cells(lambda m: _db(m["input_sqnr_db"]))),
    ]
    if len({m.get("act_calib") for m in modules}) > 1:  # e.g. what best-of picked per module
        columns.append(Column("A calib", cells(lambda m: m.get("act_calib") or "-"), drop=4))
    return columns


def layer_prefix(names: list[str]) -> tuple[str, list[str]]:
    """The layer stack's prefix (``model.layers.``, ``transformer.h.``) and the names with it
    cut, so ``model.layers.1.mlp.down_proj`` reads ``1.mlp.down_proj``. ("", names) when no
    stack or when a cut name could be mistaken for another (names that start with a digit)."""
    found = Counter(m.group(1) for n in names if (m := re.match(r"(.+?\.)\d+\.", n)))
    if not found or any(n[:1].isdigit() for n in names):
        return "", names
    prefix = found.most_common(1)[0][0]
    return prefix, [n.removeprefix(prefix) for n in names]
