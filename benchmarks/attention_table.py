"""What FP8 attention costs, as the ``fp8-attention`` block of docs/results/accuracy.md.

    python benchmarks/recipe_study.py smollm2 --articles 2 --only ROWS
    python benchmarks/recipe_study.py minilm --questions 300 --only ROWS
    python benchmarks/attention_table.py [--out out/recipes] [--doc docs/results/accuracy.md]
        [--note "machine, date"]

ROWS: ``attn-tensor,attn-head,fp8-dynamic-gptq-seq-ao-docs,fp8-dynamic-gptq-seq-ao-docs-attn-
tensor,fp8-dynamic-gptq-seq-ao-docs-attn-head`` (``recipe_study.E4M3``; ``kv-*`` rows are shown
too where cached). Reads the rows ``recipe_study.py`` cached under ``--out/MODEL-N/`` and gives
each delta its paired bootstrap 95% interval against the cached baseline and, for a row on top of
the W8A8 recipe, against the W8A8 row (the same documents / questions, so the intervals are
paired); rows not run are left out, so a partial study renders.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import recipe_study as study  # noqa: E402
from recipe_table import METRIC  # noqa: E402
from results_page import page_of, splice  # noqa: E402

from fp8ptq.evals import report  # noqa: E402
from fp8ptq.evals.stats import paired_interval  # noqa: E402

# the W8A8 recipes FP8 attention is measured on: row -> (what it is, short name)
BASES = {"fp8-dynamic": ("W8A8 FP8_DYNAMIC rounded to nearest (the default without calibration "
                         "data)", "W8A8 RTN"),
         "fp8-dynamic-gptq-seq-ao-docs": ("W8A8 default (FP8_DYNAMIC + sequential act-order "
                                          "GPTQ)", "W8A8 default")}
ADDED = {"kv-tensor": "KV cache per tensor", "kv-head": "KV cache per KV head",
         "attn-tensor": "FP8 attention per tensor", "attn-head": "FP8 attention per head"}
PARENT = {f"{base}-{k}": base for base in BASES for k in ADDED}  # row -> its W8A8 row
ROWS = {**{k: f"{v}, alone" for k, v in ADDED.items()},
        **{base: what for base, (what, _) in BASES.items()},
        **{row: f"{BASES[base][1]} + {ADDED[row.removeprefix(base + '-')]}"
           for row, base in PARENT.items()}}
MODELS = (("smollm2", 2), ("minilm", 300))


def rows(folder: Path) -> list[dict]:
    docs = [json.loads((folder / "baseline.json").read_text())]
    docs += [json.loads((folder / f"{n}.json").read_text()) for n in ROWS
             if (folder / f"{n}.json").exists()]
    out = [{**d, "records": study.records_from_json(d["records"])} for d in docs]
    report.attach_intervals(out)
    return out


def _delta(value: float, base: float, interval: dict | None, mode: str) -> str:
    if mode == "pct":
        delta, ci, unit = 100 * (value / base - 1), (interval or {}).get("pct_ci95"), "%"
    else:
        delta, ci, unit = value - base, (interval or {}).get("ci95"), " pts"
    return f"{delta:+.2f}{unit}" + (f" (95% CI {ci[0]:+.2f}..{ci[1]:+.2f})" if ci else "")


def table(folder: Path) -> str:
    rs = rows(folder)
    task = next(iter(rs[0]["metrics"])).partition(".")[0]
    key, label, mode = METRIC[task]
    metric = key.partition(".")[2]
    base = rs[0]["metrics"][key]
    by_name = {r["name"]: r for r in rs}
    lines = [f"| recipe | {label} | delta vs float | delta vs its W8A8 |", "|---|---|---|---|",
             f"| float32 (baseline) | {base:.3f} | - | - |"]
    for r in rs[1:]:
        value = r["metrics"][key]
        parent = by_name.get(PARENT.get(r["name"], ""))
        vs_w8a8 = "-"
        if parent is not None:
            iv = paired_interval(parent["records"][task], r["records"][task], metric)
            vs_w8a8 = _delta(value, parent["metrics"][key], iv, mode)
        lines.append(f"| {ROWS[r['name']]} (`{r['name']}`) | {value:.3f} | "
                     f"{_delta(value, base, r['intervals'].get(key), mode)} | {vs_w8a8} |")
    return "\n".join(lines) + "\n"


def section(out: Path, note: str) -> str:
    parts = ["## FP8 attention (`--kv-cache fp8 --quantize-attention`): per tensor vs per head",
             "",
             "What FP8 attention costs, alone (no GEMM quantized: `--skip '*'`) and on top of "
             "W8A8 recipes: Q (after RoPE), K and V observed in the one calibration pass "
             "(min-max) and rounded to e4m3 before the attention products with one scale per "
             "layer (`tensor`) or per head (`head`; the query per KV head, each group of query "
             "heads at its largest head's scale, as vLLM serves a per-head `q_scale`), exactly as "
             "`fp8ptq.load` / `eval` run a checkpoint's `q_scale` / `k_scale` / `v_scale`. The "
             "probabilities P and the products stay in float32 (an FP8 attention kernel also "
             "rounds P: not priced here). Calibration 32 x 512 tokens of "
             "`calib/wiki-paragraphs.txt` (MiniLM: the same paragraphs), models in float32. "
             f"{note}", ""]
    names = {"smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized; 9 query heads, 3 KV "
                        "heads, 30 layers), WikiText-2 test, first 2 articles, context 2048, "
                        "BOS prefix",
             "minilm": "MiniLM-SQuAD (6 layers, 12 heads, no GQA), SQuAD v1.1 held-out split, "
                       "first 300 questions (F1 in points)"}
    for model, n in MODELS:
        folder = out / f"{model}-{n}"
        if (folder / "baseline.json").exists():
            parts += [f"{names[model]}:", "", table(folder)]
    only = ",".join(k for k in ROWS if not k.endswith(("kv-tensor", "kv-head")))
    parts += ["```bash",
              f"python benchmarks/recipe_study.py smollm2 --articles 2 --only {only}",
              f"python benchmarks/recipe_study.py minilm --questions 300 --only {only}",
              "python benchmarks/attention_table.py", "```"]
    return "\n".join(parts) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "out/recipes"))
    ap.add_argument("--doc", default=str(page_of("fp8-attention")))
    ap.add_argument("--note", default="", help="machine, date and load of the measurement")
    ap.add_argument("--reading", default=str(ROOT / "benchmarks/attention_reading.md"),
                    help="the conclusions drawn from the tables (written by hand)")
    args = ap.parse_args(argv)
    text = section(Path(args.out), args.note)
    if args.reading and Path(args.reading).exists():
        text += "\n" + Path(args.reading).read_text().strip() + "\n"
    doc = Path(args.doc)
    doc.write_text(splice(doc.read_text(), text, "fp8-attention"))
    print(text)


if __name__ == "__main__":
    main()
