"""The "two families for every default" block of docs/results/studies.md: what each default of
the recipe rests on, on SmolLM2-135M and gemma-3-270m, from the studies' own reports.

    python benchmarks/studies/two_families.py --precision out/sweep-precision-smollm2/report.json
        --precision out/sweep-precision-gemma/report.json
        --precision out/sweep-precision-synthetic/report.json
        [--sink-cost out/sink-cost/report.json] [--cli-runs runs.json]
        [--doc docs/results/studies.md]

``--precision``: ``benchmarks/studies/sweep_precision.py`` reports (per-GEMM layer output error of
the float32, float64 and mixed sweeps); ``--sink-cost``: ``benchmarks/studies/sink_cost.py``'s
report;
``--cli-runs``: a JSON list of whole ``fp8ptq quantize`` runs (``command``, ``note``,
``seconds`` {stage: s}, ``peak_rss_mb``, ``cpu_s``), the timing lines those commands printed.
The perplexity rows come from the blocks they cite (not re-run here).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: results_page

from results_page import md_table, page_of, splice  # noqa: E402

BLOCK = "two-families"


def precision_rows(reports: list[dict]) -> list[list]:
    """Per model and input width: the mean relative excess of float32's and mixed's held-out
    output error over float64's, with a normal 95% interval over the GEMMs."""
    rows = []
    for rep in reports:
        model = Path(rep["model"]).name
        for width in sorted({r["in"] for r in rep["rows"]}):
            sel = [r for r in rep["rows"] if r["in"] == width]
            cells = [model, width, len(sel)]
            for p in ("float32", "mixed"):
                d = [(r[p] - r["float64"]) / r["float64"] * 100 for r in sel]
                m = sum(d) / len(d)
                sd = math.sqrt(sum((x - m) ** 2 for x in d) / max(len(d) - 1, 1))
                half = 1.96 * sd / math.sqrt(len(d))
                cells.append(f"{m:+.4f}% ({m - half:+.4f}..{m + half:+.4f}); "
                             f"{sum(x > 0 for x in d)} of {len(d)} worse")
            differ = sum(r["float32_codes_differ"] for r in sel) / len(sel)
            secs = [sum(r[p + "_s"] for r in sel) for p in ("float32", "float64", "mixed")]
            cells += [f"{differ:.1e}", " / ".join(f"{s:.0f}" for s in secs)]
            rows.append(cells)
    return rows


def sink_rows(report: dict) -> list[list]:
    rows = []
    for r in report["runs"]:
        prof = r["profile_s"]
        sink_s = prof.get("sink.own", 0.0)
        rows.append([r["rep"], f"`--gptq-sink {r['sink']:g}`", r["cpu_s"], r["wall_s"],
                     f"{r['rss_before_mb']} -> {r['rss_after_mb']}",
                     f"{prof.get('sweep.gptq_codes', 0):.1f}", f"{sink_s:.1f}"])
    return rows


def cli_rows(runs: list[dict]) -> list[list]:
    return [[f"`{r['command']}`", r["note"],
             ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items()),
             r.get("cpu_s", "-"), f"{r['peak_rss_mb']:.0f}"] for r in runs]


def _slice(rep: dict) -> str:
    if rep["model"] == "synthetic":
        return f"synthetic, seeds {rep['seeds']}" + (f" ({rep['note']})" if "note" in rep else "")
    return (f"{Path(rep['model']).name}: one-pass Hessians of the float32 model from "
            f"{rep.get('num_samples', 32)} x 512 document windows of calib/wiki-paragraphs.txt "
            f"(seed {rep.get('seeds', 0)}), held-out Gram matrices from the first "
            f"{rep.get('heldout_tokens', 4096)} tokens of WikiText-2 test in windows of 512 "
            f"opened with token {rep.get('start_ids')}")


def render(precision: list[dict], sink: dict | None, cli: list[dict], text: str) -> str:
    parts = [text.strip(), ""]
    if cli:
        parts += ["Whole `fp8ptq quantize` runs (the timing line each printed; `/usr/bin/time`'s "
                  "CPU seconds):", "",
                  md_table(["command", "run", "stage seconds", "CPU s", "peak RSS MiB"],
                           cli_rows(cli)), ""]
    if sink:
        parts += ["Sink-aware against plain GPTQ in one process "
                  "(`benchmarks/studies/sink_cost.py`, "
                  f"first {sink['blocks']} blocks of {Path(sink['model']).name}, "
                  f"{sink['num_samples']} x 512 windows, {sink['date']}"
                  + (f"; {sink['note']}" if "note" in sink else "") + "; seconds of "
                  "calibrate + quantize, and cProfile's cumulative seconds in the column "
                  "sweeps and in the sink's own work, `SinkCollector.aim` and its first rows in "
                  "`_accumulate`):",
                  "", md_table(["rep", "run", "CPU s", "wall s", "RSS MiB", "sweeps s",
                                "sink s"], sink_rows(sink)), ""]
    if precision:
        dates = sorted({r.get("date", "") for r in precision})
        parts += [f"GPTQ sweep precision, layer output error against float64's "
                  f"(`benchmarks/studies/sweep_precision.py`, {', '.join(dates)}): the relative "
                  "excess of the held-out output error `tr(D G D^T) / tr(W G W^T)` (synthetic: "
                  "GPTQ's own objective), mean over the GEMMs of that width with a normal 95% "
                  "interval; the fraction of codes that differ from float64's; seconds of the "
                  "three sweeps (float32 / float64 / mixed):", "",
                  "Slices: " + "; ".join(_slice(r) for r in precision) + ".", "",
                  md_table(["model", "input width", "GEMMs", "float32 - float64",
                            "mixed - float64", "codes differ (float32)", "sweep s"],
                           precision_rows(precision)), ""]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", action="append", default=[])
    ap.add_argument("--sink-cost")
    ap.add_argument("--cli-runs")
    ap.add_argument("--text", required=True, help="markdown file: the block's prose and table")
    ap.add_argument("--doc", default=str(page_of(BLOCK)))
    args = ap.parse_args()
    precision = [json.loads(Path(p).read_text()) for p in args.precision]
    sink = json.loads(Path(args.sink_cost).read_text()) if args.sink_cost else None
    cli = json.loads(Path(args.cli_runs).read_text()) if args.cli_runs else []
    block = render(precision, sink, cli, Path(args.text).read_text())
    if args.doc:
        Path(args.doc).write_text(splice(Path(args.doc).read_text(), block, BLOCK))
    print(block)


if __name__ == "__main__":
    main()
