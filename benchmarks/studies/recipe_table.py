"""Renders the recipe study beside llm-compressor (SmolLM2-135M, MiniLM): the ``recipes`` block.

    python benchmarks/studies/recipe_table.py [--out out/recipes] [--doc docs/results/studies.md]

Reads the rows ``recipe_study.py`` and ``compare_llmcompressor.py`` cached under
``--out/MODEL-N/`` (one JSON per recipe or checkpoint, with the per-document / per-question
records), recomputes every delta's paired bootstrap 95% interval against the one cached baseline
(``fp8ptq.evals.report.attach_intervals``), and replaces the block between the
``<!-- recipes:begin -->`` / ``<!-- recipes:end -->`` markers of ``--doc`` (appended if absent;
``reproduce.py`` keeps the block when it regenerates the rest of the page). Rows that were not
run are left out, so a partial study renders.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import recipe_study as study  # noqa: E402
from results_page import page_of, splice  # noqa: E402

from fp8ptq.evals import report  # noqa: E402
from fp8ptq.evals.stats import paired_interval  # noqa: E402

# row name -> (what it is, how vLLM serves it); llm-compressor rows are "llmc-SCHEME"
ROWS = {
    "w-only": ("e4m3 weight-only, channel W, round to nearest", "FP8 Marlin (W8A16)"),
    "w-only-gptq": ("e4m3 weight-only, channel W, GPTQ", "FP8 Marlin (W8A16)"),
    "static": ("channel W + static tensor A (the old default)", "channel W x tensor A scaled_mm"),
    "fp8-static": ("`--scheme fp8-static`: tensor W + static tensor A", "per-tensor scaled_mm"),
    "fp8-static-gptq": ("`fp8-static` + GPTQ", "per-tensor scaled_mm"),
    "fp8-static-best": ("`fp8-static` + `--act-calib best`", "per-tensor scaled_mm"),
    # an experiment, not kept (commit 8174815, reverted): each static input scale chosen among
    # best's candidates and amax x 2^(-k/8), k <= 24, by the GEMM's output MSE on sampled rows
    "fp8-static-search": ("`fp8-static` + clip search by output MSE (experiment, not kept)",
                          "per-tensor scaled_mm"),
    "fp8-dynamic": ("`--scheme fp8-dynamic`: channel W + dynamic token A", "row-wise scaled_mm"),
    "fp8-dynamic-gptq": ("`fp8-dynamic` + GPTQ", "row-wise scaled_mm"),
    "fp8-dynamic-gptq-mse": ("`fp8-dynamic` + GPTQ with MSE scales", "row-wise scaled_mm"),
    "fp8-dynamic-gptq-ao": ("`fp8-dynamic` + GPTQ with `--gptq-act-order`", "row-wise scaled_mm"),
    "fp8-dynamic-gptq-seq-ao": ("`fp8-dynamic` + sequential GPTQ act-order, random windows",
                                "row-wise scaled_mm"),
    "w-only-gptq-seq-ao": ("e4m3 weight-only, channel W, sequential GPTQ act-order",
                           "FP8 Marlin (W8A16)"),
    # the same, calibrated on windows that open a document after the BOS (--calib-windows)
    "fp8-dynamic-gptq-seq-ao-docs": ("`fp8-dynamic` + sequential GPTQ act-order, "
                                     "document windows (the default)", "row-wise scaled_mm"),
    "fp8-dynamic-gptq-seq-ao-docs-asym": ("`fp8-dynamic` + sequential GPTQ act-order, document "
                                          "windows, `--gptq-asym` (asymmetric GPTQ)",
                                          "row-wise scaled_mm"),
    # weight scales by the Hessian-diagonal-weighted rounding error (calibrators/hmse.py)
    "fp8-dynamic-gptq-seq-ao-docs-hmse": ("the default with `--weight-calib gptq-hmse` "
                                          "(Hessian-weighted weight scales)",
                                          "row-wise scaled_mm"),
    "fp8-dynamic-hmse": ("`fp8-dynamic` + `--weight-calib hmse` (Hessian-weighted scales, "
                         "round to nearest)", "row-wise scaled_mm"),
    "hif8-dynamic-gptq-seq-ao-docs-hmse": ("HiF8, the default recipe with document windows "
                                           "and `--weight-calib gptq-hmse`",
                                           "- (no HiF8 kernels)"),
    "fp8-dynamic-sqa5-gptq-seq-ao-docs": ("the default + `--smoothquant 0.5 --smoothquant-into "
                                          "all`", "row-wise scaled_mm"),
    "fp8-dynamic-sqa5-gptq-seq-ao-docs-hmse": ("the default with `gptq-hmse` + `--smoothquant "
                                               "0.5 --smoothquant-into all`",
                                               "row-wise scaled_mm"),
    "w-only-gptq-seq-ao-docs": ("e4m3 weight-only, sequential GPTQ act-order, "
                                "`--calib-windows documents`", "FP8 Marlin (W8A16)"),
    "fp8-dynamic-rot-gptq": ("`fp8-dynamic` + `--rotate hadamard` + GPTQ act-order (one pass)",
                             "row-wise scaled_mm"),
    # SmoothQuant folded into the GEMM -> GEMM pairs (up_proj -> down_proj, v_proj -> o_proj)
    "fp8-dynamic-sqg5-gptq-seq-ao-docs": ("the default + `--smoothquant 0.5 --smoothquant-into "
                                          "gemms`", "row-wise scaled_mm"),
    "fp8-dynamic-sqg8-gptq-seq-ao-docs": ("the default + `--smoothquant 0.8 --smoothquant-into "
                                          "gemms`", "row-wise scaled_mm"),
    "fp8-block": ("`--scheme fp8-block`: 128x128 W + dynamic 1x128 A", "block-scaled GEMM"),
    "fp8-block-gptq": ("`fp8-block` + GPTQ", "block-scaled GEMM"),
    "fp8-block-gptq-seq-ao-docs": ("`fp8-block` + sequential GPTQ act-order, document windows",
                                   "block-scaled GEMM (dims in whole 128-blocks: not SmolLM2's)"),
    # analysis: weights left float (recipe_study.FLOAT_WEIGHTS), the activation schemes' floors
    "a-only-fp8-dynamic": ("analysis: activations only, dynamic per-token (weights float)",
                           "-"),
    "a-only-fp8-group": ("analysis: activations only, dynamic 1x128 groups (weights float)",
                         "-"),
    "a-only-mxfp8": ("analysis: activations only, MXFP8 1x32 E8M0, OCP floor exponent "
                     "(weights float)", "-"),
    "a-only-mxfp8-ru": ("analysis: activations only, MXFP8 1x32 E8M0, vLLM's round-up exponent "
                        "(weights float)", "-"),
    "mxfp8": ("`--format mxfp8`: OCP MXFP8 W + dynamic A (1x32 E8M0), round to nearest",
              "CompressedTensorsW8A8Mxfp8 (Blackwell)"),
    "mxfp8-ru": ("MXFP8 W + A with vLLM's round-up exponent (analysis), round to nearest",
                 "CompressedTensorsW8A8Mxfp8 (Blackwell)"),
    # the default recipe with --target-delta 1%: a checkpoint written by `fp8ptq quantize`
    # (its --json report cached as target-1pct-quantize.json); mixed precision
    "target-1pct": ("the default + `--target-delta 1%` (mixed: some GEMMs kept bf16)",
                    "row-wise scaled_mm + bf16 GEMMs"),
    # the same with --target-metric kl (target-1pct-kl-quantize.json)
    "target-1pct-kl": ("the default + `--target-delta 1% --target-metric kl` (mixed)",
                       "row-wise scaled_mm + bf16 GEMMs"),
    # control: the blocks the perplexity-delta metric keeps on the KL run's selection slice,
    # skipped by hand (`quantize --skip`, same calibration documents)
    "target-1pct-pplchoice": ("control: the 6 blocks perplexity deltas pick on that slice, "
                              "`--skip`ped (mixed)", "row-wise scaled_mm + bf16 GEMMs"),
    "hif8-dynamic": ("HiF8, channel W + dynamic token A (`fp8-dynamic`'s rule)",
                     "- (no HiF8 kernels)"),
    "hfp8-dynamic": ("HFP8 (E4M3 W / E5M2 A), channel W + dynamic token A",
                     "- (fp8ptq-native)"),
    "hif8-dynamic-gptq": ("HiF8, channel W + dynamic token A + GPTQ", "- (no HiF8 kernels)"),
    "hfp8-dynamic-gptq": ("HFP8 (E4M3 W / E5M2 A), channel W + dynamic token A + GPTQ",
                          "- (fp8ptq-native)"),
    "hif8-dynamic-gptq-seq-ao": ("HiF8, the default recipe (`--format hif8`)",
                                 "- (no HiF8 kernels)"),
    "hif8-dynamic-gptq-seq-ao-docs": ("HiF8, the default recipe with document windows "
                                      "(`--format hif8`)", "- (no HiF8 kernels)"),
    "hfp8-dynamic-gptq-seq-ao": ("HFP8 (E4M3 W / E5M2 A), the default recipe (`--format hfp8`)",
                                 "- (fp8ptq-native)"),
    "llmc-FP8": ("llm-compressor `FP8`: tensor W + static tensor A, fp8ptq's windows",
                 "per-tensor scaled_mm"),
    "llmc-FP8_DYNAMIC": ("llm-compressor `FP8_DYNAMIC`: channel W + dynamic token A",
                         "row-wise scaled_mm"),
    "llmc-FP8_BLOCK": ("llm-compressor `FP8_BLOCK`: 128x128 W + dynamic 1x128 A",
                       "block-scaled GEMM"),
    "llmc-GPTQ-FP8": ("llm-compressor `GPTQModifier` `FP8`", "per-tensor scaled_mm"),
    "llmc-GPTQ-FP8_DYNAMIC": ("llm-compressor `GPTQModifier` `FP8_DYNAMIC`",
                              "row-wise scaled_mm"),
    # llm-compressor calibrated on its own data: the first 32 paragraphs, each cut to 512 tokens
    # (~150 tokens each, a third of the tokens of fp8ptq's 32 x 512 windows)
    "llmc-FP8-paragraphs": ("llm-compressor `FP8`, calibrated on 32 paragraphs",
                            "per-tensor scaled_mm"),
    "llmc-GPTQ-FP8-paragraphs": ("llm-compressor `GPTQModifier` `FP8`, 32 paragraphs",
                                 "per-tensor scaled_mm"),
    "llmc-GPTQ-FP8_DYNAMIC-paragraphs": ("llm-compressor `GPTQModifier` `FP8_DYNAMIC`, "
                                         "32 paragraphs", "row-wise scaled_mm"),
    "llmc-MXFP8": ("llm-compressor `MXFP8` (round to nearest)",
                   "CompressedTensorsW8A8Mxfp8 (Blackwell)"),
    "llmc-GPTQ-MXFP8": ("llm-compressor `GPTQModifier` `MXFP8`, fp8ptq's windows",
                        "CompressedTensorsW8A8Mxfp8 (Blackwell)"),
}
METRIC = {"wikitext": ("wikitext.word_perplexity", "word ppl", "pct"),
          "squad": ("squad.f1", "F1", "abs")}


def _rows(folder: Path) -> list[dict]:
    docs = [json.loads((folder / "baseline.json").read_text())]
    docs += [json.loads((folder / f"{n}.json").read_text()) for n in ROWS
             if (folder / f"{n}.json").exists()]
    rows = [{**d, "records": study.records_from_json(d["records"])} for d in docs]
    report.attach_intervals(rows)
    return rows


def _quantize_facts(folder: Path, name: str, row: dict) -> tuple[str, str]:
    """Quantize wall seconds and peak RSS: llm-compressor's child process (``llmc_run.json``),
    fp8ptq's ``quantize`` child when timed (``--timings``), else the in-process
    calibrate+quantize seconds of the eval row (no RSS: the row's process also evaluated)."""
    run = folder / name / "llmc_run.json" if name.startswith("llmc-") else \
        folder / f"fp8ptq-{name}.json"
    if run.exists():
        facts = json.loads(run.read_text())
        return f"{facts['wall_seconds']:.0f}", f"{facts['peak_rss_mb']:.0f}"
    quantize = folder / f"{name}-quantize.json"  # an `fp8ptq quantize --json` report
    if quantize.exists() and quantize.stat().st_size:
        facts = json.loads(quantize.read_text())
        seconds = sum(v for k, v in facts["seconds"].items()
                      if k in ("target: sensitivity", "calibrate+quantize", "target: verify"))
        return f"({seconds:.0f})", f"{facts['peak_rss_mb']:.0f}"
    seconds = (row.get("timings") or {}).get("calibrate+quantize")
    return ("-" if seconds is None else f"({seconds:.0f})"), "-"


def table(folder: Path) -> str:
    rows = _rows(folder)
    task = next(iter(rows[0]["metrics"])).partition(".")[0]
    key, label, mode = METRIC[task]
    base = rows[0]["metrics"][key]
    unit = "%" if mode == "pct" else " pts"
    lines = [f"| recipe | tool | {label} | delta{unit} (95% CI) | quantize s | peak RSS MB "
             "| vLLM |",
             "|---|---|---|---|---|---|---|",
             f"| bf16 model (float32 here) | - | {base:.3f} | - | - | - | - |"]
    for row in rows[1:]:
        value = row["metrics"][key]
        iv = (row.get("intervals") or {}).get(key) or {}
        if mode == "pct":
            delta, ci = 100 * (value / base - 1), iv.get("pct_ci95")
        else:
            delta, ci = value - base, iv.get("ci95")
        cell = f"{delta:+.2f}" + (f" ({ci[0]:+.2f}..{ci[1]:+.2f})" if ci else "")
        what, vllm = ROWS[row["name"]]
        tool = "llm-compressor" if row["name"].startswith("llmc-") else "fp8ptq"
        seconds, rss = _quantize_facts(folder, row["name"], row)
        lines.append(f"| {what} | {tool} | {value:.3f} | {cell} | {seconds} | {rss} | {vllm} |")
    text = "\n".join(lines) + "\n\n" + head_to_head(rows, key, mode)
    targets = [line for line in (target_line(folder, n) for n in TARGETS) if line]
    return text + "".join("\n\n" + line for line in targets)


def target_line(folder: Path, name: str = "target-1pct") -> str:
    """What ``quantize --target-delta 1%`` decided and predicted, from its cached ``--json``
    report (``NAME-quantize.json``): modules per rung, the GEMMs kept in high precision,
    predicted against measured delta on its own held-out slice and on the verification
    slice."""
    path = folder / f"{name}-quantize.json"
    if not path.exists() or not path.stat().st_size:
        return ""
    t = json.loads(path.read_text()).get("target_delta")
    if not t:
        return ""
    kept = [u["unit"] for u in t["units"] if u["rung"] == "fallback"]
    per_rung = ", ".join(f"{k} {v}" for k, v in t["modules_per_rung"].items())
    ev = t["eval"]
    measured = "not measured" if t["measured_delta_pct"] is None else \
        f"{t['measured_delta_pct']:+.2f}%"
    metric = f" --target-metric {t['metric']}" if t.get("metric", "ppl") != "ppl" else ""
    return (f"`--target-delta {t['target']}{metric}` (row `{name}`): GEMMs per rung "
            f"{per_rung}; on its selection slice ({ev['tokens']:,} tokens of held-out "
            f"calibration documents, {ev['windows']} x {ev['seq_len']}) predicted "
            f"{t['predicted_pct']:+.2f}% (all on the base rung: "
            f"{100 * t['predicted_base'] / t['baseline']:+.2f}%), measured {measured}. "
            f"Kept in high precision: {', '.join(f'`{m}`' for m in kept) or 'none'}."
            + _verify_sentence(t.get("verify")))


def _verify_sentence(v: dict | None) -> str:
    if not v:
        return ""
    which = "other held-out documents, not chosen on" if v.get("disjoint") else \
        "held-out tokens, overlapping the selection's documents"
    return (f" On the verification slice ({v['tokens']:,} tokens of {which}; "
            f"{v['windows']} x {v['seq_len']}, windows opening documents) measured "
            f"{v['delta_pct']:+.2f}%.")


W8A16 = ("w-only", "w-only-gptq", "w-only-gptq-seq-ao", "w-only-gptq-seq-ao-docs")
TARGETS = ("target-1pct", "target-1pct-kl")  # rows with a `quantize --target-delta --json`
MIXED = (*TARGETS, "target-1pct-pplchoice")  # some GEMMs kept in high precision: not all-FP8


def head_to_head(rows: list[dict], key: str, mode: str) -> str:
    """fp8ptq's best e4m3 W8A8 row against llm-compressor's best, with the paired 95% interval
    of the difference (the same documents / questions resampled for both)."""
    task, _, metric = key.partition(".")
    higher = mode == "abs"  # F1: higher is better; perplexity: lower

    def best(rows_):
        return (max if higher else min)(rows_, key=lambda r: r["metrics"][key], default=None)

    ours = best([r for r in rows[1:] if not r["name"].startswith(("llmc-", "hif8", "hfp8"))
                 and r["name"] not in W8A16 + MIXED])
    theirs = best([r for r in rows[1:] if r["name"].startswith("llmc-")])
    if ours is None or theirs is None:
        return ""
    iv = paired_interval(theirs["records"][task], ours["records"][task], metric)
    a, b = ours["metrics"][key], theirs["metrics"][key]
    if mode == "pct":
        diff, ci, unit = 100 * (a / b - 1), iv and iv["pct_ci95"], "%"
    else:
        diff, ci, unit = a - b, iv and iv["ci95"], " points"
    span = f" (95% CI {ci[0]:+.2f}..{ci[1]:+.2f}{unit})" if ci else ""
    return (f"Best e4m3 W8A8 of each tool: fp8ptq `{ours['name']}` {a:.3f} against "
            f"llm-compressor `{theirs['name'].removeprefix('llmc-')}` {b:.3f}: "
            f"{diff:+.2f}{unit}{span}, paired over the same samples.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "out/recipes"))
    ap.add_argument("--doc", default=str(page_of("recipes")))
    ap.add_argument("--intro", default=str(ROOT / "benchmarks/studies/recipes_intro.md"),
                    help="the block's markdown ({smollm2} / {minilm}: the tables, {reading})")
    ap.add_argument("--reading", default=str(ROOT / "benchmarks/studies/recipes_reading.md"),
                    help="the conclusions drawn from the tables (written by hand)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    tables = {m: table(out / f"{m}-{n}") if (out / f"{m}-{n}/baseline.json").exists()
              else "(not run)" for m, n in (("smollm2", 5), ("minilm", 1000))}
    reading = Path(args.reading).read_text() if Path(args.reading).exists() else ""
    text = Path(args.intro).read_text().format(**tables, reading=reading.strip())
    doc = Path(args.doc)
    doc.write_text(splice(doc.read_text(), text))
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
