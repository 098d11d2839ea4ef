"""Renders docs/results/accuracy.md from reproduce.py's JSON; the page each marked block is on.

No model runs here. The results are one summary page (docs/results.md, written by hand) and
topic pages under docs/results/; every section a script writes is a marked block
(``<!-- NAME:begin -->`` ... ``<!-- NAME:end -->``) on the page ``BLOCKS`` names, replaced in
place when its script runs again (``splice``), and kept when ``reproduce.py`` regenerates the
accuracy page around its blocks (``kept_blocks``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from pathlib import Path

from fp8ptq.numbers import fmt_num

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
# marked block -> the topic page under docs/results/ that holds it (the default --doc of the
# script that writes it; tests/test_results_page.py checks every page against this table)
BLOCKS = {
    "kv-cache": "accuracy.md",  # by hand, from recipe_study.py's kv rows
    "benchmarks": "speed.md",  # by hand: bench_all.py's runs
    "main-job": "speed.md",  # by hand: scripts/demo.sh
    "measurements-speed": "speed.md",  # by hand: figures behind docs/ and code comments
    "test-suite": "speed.md",  # by hand
    "measurements-memory": "memory.md",  # by hand
    "gpu": "gpu.md",  # gpu_results.py, from data/gpu/
    "recipes": "studies.md",  # studies/recipe_table.py
    "recipes-figures": "studies.md",  # by hand: figures behind docs/recipes.md
    "calib-size": "studies.md",  # studies/calib_size_study.py
    "llmc-compare": "llm-compressor.md",  # llmc_vs_default.py
    "llmc-compare-minilm": "llm-compressor.md",  # llmc_vs_default.py minilm
    "llmc-compare-gemma": "llm-compressor.md",  # llmc_vs_default.py gemma
    "error-budget": "llm-compressor.md",  # studies/error_budget.py
    "squad-budget": "llm-compressor.md",  # studies/squad_budget.py
    "llmc-reading": "llm-compressor.md",  # by hand
    "moe-gptq": "llm-compressor.md",  # moe_gptq.py
    "two-families": "studies.md",  # two_families.py
    "loss-parts": "studies.md",  # studies/loss_parts.py
    "loss-parts-every": "studies.md",  # studies/loss_parts.py --window-start every
    "fp8-attention": "accuracy.md",  # attention_table.py
}
ACCURACY = RESULTS / "accuracy.md"  # reproduce.py's page: rendered around its marked blocks


def page_of(block: str) -> Path:
    """The page that holds marked block ``block``."""
    return RESULTS / BLOCKS[block]


WORD_PPL = "wikitext.word_perplexity"
TOKEN_PPL = "wikitext.token_perplexity"


def _num(v, digits=3) -> str:
    """``digits`` significant digits, whole numbers from ``10 ** digits`` up; "-" when missing."""
    if isinstance(v, float) and math.isfinite(v) and abs(v) >= 10 ** digits:
        return f"{v:.0f}"
    return fmt_num(v, f"{{:.{digits}g}}") if isinstance(v, float) or v is None else str(v)


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_num(c) if not isinstance(c, str) else c for c in row) + " |"
              for row in rows]
    return "\n".join(lines) + "\n"


def command(exp, s) -> str:
    argv = exp.argv
    prefix = ["python"] if argv[0].endswith(".py") else ["fp8ptq"]
    text = shlex.join(prefix + argv)
    root = str(ROOT)
    return text.replace(str(s.assets), "../shared/assets").replace(root + "/", "").replace(
        str(s.out), "out/results")


def variants(exp) -> list[dict]:
    return exp.result.get("variants", []) if exp.result else []


def _rel(v: dict, base: dict, metric: str) -> float | None:
    a, b = v["metrics"].get(metric), base["metrics"].get(metric)
    return None if a is None or b in (None, 0) else 100.0 * (a - b) / b


def eval_rows(exp, metrics: list[str], label=None) -> list[list]:
    vs = variants(exp)
    if not vs:
        return []
    base = vs[0]
    rows = []
    for v in vs:
        row = [label(v) if label else v["name"]]
        for m in metrics:
            row.append(v["metrics"].get(m))
            if v is not base:
                d = _rel(v, base, m)
                row[-1] = f"{_num(v['metrics'].get(m), 4)} ({d:+.1f}%)" if d is not None else "-"
            else:
                row[-1] = _num(row[-1], 4)
        timings = v.get("timings") or {}
        row.append(_num(timings.get("calibrate+quantize")) if v is not base else "-")
        row.append(_num(v.get("seconds")))
        rows.append(row)
    return rows


def protocol_line(exp) -> str:
    proto = (exp.result or {}).get("protocol") or {}
    parts = []
    for task, p in proto.items():
        if isinstance(p, dict):
            parts.append(f"{task}: " + ", ".join(f"{k} {v}" for k, v in p.items()
                                                 if not isinstance(v, (dict, list))))
    return "; ".join(parts)


def section(exp, s, title: str, text: str, metrics: list[str], names: list[str]) -> str:
    if not exp.result:
        return f"## {title}\n\n_not run yet_ (`{command(exp, s)}`)\n\n"
    out = [f"## {title}\n\n{text}\n\n```bash\n{command(exp, s)}\n```\n\n"]
    out.append(md_table(["variant", *names, "quantize s", "eval s"], eval_rows(exp, metrics)))
    out.append(f"\nProtocol: {protocol_line(exp)}.\n\n")
    return "".join(out)


CALIB_SOURCES = {"max": "format_sweep", "percentile": "calib_percentile", "mse": "calib_mse",
                 "best": "table5_smollm2", "pow2-search": "calib_pow2-search",
                 "smoothquant": "calib_smoothquant"}


def calib_section(exps: dict, s) -> tuple[str, list[str]]:
    rows, cmds = [], []
    for fmt in ("e4m3", "int8", "hif8"):
        for method, source in CALIB_SOURCES.items():
            exp = exps.get(source)
            vs = variants(exp) if exp else []
            hit = [v for v in vs[1:] if v["name"] == fmt]
            if not hit:
                continue
            v, base = hit[0], vs[0]
            rows.append([fmt, method, f"{v['metrics'][WORD_PPL]:.4g} "
                         f"({_rel(v, base, WORD_PPL):+.1f}%)",
                         _num((v.get("timings") or {}).get("calibrate+quantize")),
                         _num(base["metrics"][WORD_PPL], 4)])
    for source in CALIB_SOURCES.values():
        if exps.get(source) and exps[source].result and source not in ("format_sweep",
                                                                       "table5_smollm2"):
            cmds.append(command(exps[source], s))
    text = md_table(["format", "activation calibration", "word ppl (vs bf16)",
                     "calibrate+quantize s", "bf16 word ppl"], rows)
    return text, cmds


def sweep_plot(exp, out: Path, plt) -> str | None:
    vs = variants(exp)
    if not vs:
        return None
    base = vs[0]["metrics"][WORD_PPL]
    names = [v["name"] for v in vs[1:]]
    rel = [_rel(v, vs[0], WORD_PPL) for v in vs[1:]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, rel, color=["tab:red" if n == "int8" else "tab:blue" for n in names])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("word perplexity change vs bf16 (%)")
    ax.set_title(f"SmolLM2-135M, WikiText-2 slice (bf16 word ppl {base:.2f})")
    ax.set_yscale("symlog", linthresh=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def bias_plot(plain, residual, out: Path, plt) -> str | None:
    if not variants(plain):
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for exp, label in ((plain, "GEMM inputs"), (residual, "GEMM + residual inputs")):
        vs = variants(exp)
        if not vs:
            continue
        xs = [int(v["name"].split("b")[1].rstrip("fn")) for v in vs[1:]]
        ax.plot(xs, [v["metrics"][WORD_PPL] for v in vs[1:]], marker="o", label=label)
        ax.axhline(vs[0]["metrics"][WORD_PPL], color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel("E4M3 exponent bias (7 = OCP)")
    ax.set_ylabel("word perplexity")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("direct cast, no calibration (dashed: bf16)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def render(exps: dict, s, plt) -> str:
    figs = ROOT / "docs" / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    wt = [WORD_PPL, TOKEN_PPL]
    wt_names = ["word ppl", "token ppl"]
    parts = [HEADER]
    parts.append(section(exps["table5_smollm2"], s,
                         "Micikevicius et al. 2022 Table 5 analogue: SmolLM2-135M, WikiText-2",
                         TABLE5_TEXT, wt, wt_names))
    parts.append(section(exps["table5_minilm"], s,
                         "Micikevicius et al. 2022 Table 5 analogue: MiniLM SQuAD",
                         SQUAD_TEXT, ["squad.exact_match", "squad.f1"], ["EM", "F1"]))
    parts.append(section(exps["format_sweep"], s, "Format sweep", SWEEP_TEXT, wt, wt_names))
    png = sweep_plot(exps["format_sweep"], figs / "format_sweep.png", plt)
    if png:
        parts.append(f"![format sweep](../figures/{png})\n\n")
    table, cmds = calib_section(exps, s)
    parts.append("## Calibrator comparison\n\n" + CALIB_TEXT + "\n\n" + table + "\n")
    parts.append("Commands (`max` rows: the format sweep; `best` rows: the Table 5 run):"
                 "\n\n```bash\n"
                 + "\n".join(cmds) + "\n```\n\n")
    t8 = exps["table8_hif8_cast"]
    parts.append(section(t8, s, "Luo et al. 2024 Table 8 analogue: HiF8 direct cast vs "
                         "power-of-two scaling vs SmoothQuant", TABLE8_TEXT, wt, wt_names))
    parts.append(section(exps["fig2_bias_sweep"], s,
                         "Micikevicius et al. 2022 Figure 2 analogue: exponent-bias sweep "
                         "without calibration", FIG2_TEXT, wt, wt_names))
    parts.append(section(exps["fig2_bias_sweep_residual"], s, "... with residual inputs "
                         "quantized too", "", wt, wt_names))
    png = bias_plot(exps["fig2_bias_sweep"], exps["fig2_bias_sweep_residual"],
                    figs / "bias_sweep.png", plt)
    if png:
        parts.append(f"![bias sweep](../figures/{png})\n\n")
    parts.append(digits_section(exps["table1_digits_cnn"], s))
    parts.append(sensitivity_section(exps["sensitivity"], s, figs))
    return "".join(parts)


def digits_section(exp, s) -> str:
    head = ("## Sun et al. 2019 Table 1 analogue: digits CNN with BatchNorm re-tuning\n\n"
            + DIGITS_TEXT)
    if not exp.result:
        return head + f"\n\n_not run yet_ (`{command(exp, s)}`)\n\n"
    rows = exp.result["rows"]
    cols = [c for c in rows[1] if c.startswith("acc ")]
    body = md_table(["format", "scales", *[c[4:] for c in cols]],
                    [[r["format"], r["scales"], *[r.get(c) for c in cols]] for r in rows])
    return head + f"\n\n```bash\n{command(exp, s)}\n```\n\n" + body + "\n"


def sensitivity_section(exp, s, figs: Path) -> str:
    head = "## Per-layer sensitivity\n\n" + SENS_TEXT
    if not exp.result:
        return head + f"\n\n_not run yet_ (`{command(exp, s)}`)\n\n"
    out = [head, f"\n\n```bash\n{command(exp, s)}\n```\n\n"]
    r = exp.result
    fmt = (r.get("suggestion") or {}).get("format", "e4m3")
    units = sorted(r.get("units") or [], key=lambda u: -u["results"][fmt]["delta"])[:8]
    out.append(f"Baseline perplexity on the slice: {r['baseline']:.3f}.\n\n")
    out.append(md_table(["block", f"{fmt} perplexity", "delta"], [
        [u["name"], u["results"][fmt]["value"], f"{u['results'][fmt]['delta']:+.3f}"]
        for u in units]))
    checks, sug = r.get("checks") or {}, r.get("suggestion") or {}
    if checks:
        out.append(f"\nEverything quantized: {checks['all_quantized']['perplexity']:.3f} "
                   f"({checks['all_quantized']['delta']:+.3f}); suggestion for a "
                   f"{sug.get('target')} target (`--skip {' --skip '.join(sug.get('skip', []))}`)"
                   f": {checks['suggested']['perplexity']:.3f} "
                   f"({checks['suggested']['delta']:+.3f}).\n")
    for png in sorted(s.out.glob("sensitivity*.png")):
        target = figs / png.name
        target.write_bytes(png.read_bytes())
        out.append(f"\n![{png.stem}](../figures/{png.name})\n")
    return "".join(out) + "\n"


HEADER = """# Results: accuracy against the papers' tables

[Summary](../results.md). Generated by `python benchmarks/reproduce.py` (do not edit by hand,
except inside the marked blocks, which it keeps): every number below comes from the fp8ptq CLI
on the offline assets in `../shared/assets`, on a 2-core CPU without a GPU; the exact commands
are listed with each table. FP8 is simulated on CPU (weights decoded from their codes,
activations quantize-dequantized), which gives the same numbers a real FP8 GEMM with fp32
accumulation would, up to accumulation order. Speed: [speed.md](speed.md).

Evaluation slices (this CPU runs SmolLM2-135M at a few hundred tokens/s): WikiText-2 test, first
3 articles (8,272 words, ~11k tokens) for the main tables, first article for the bias sweep,
context 2048; SQuAD v1.1 held-out split, first 1,000 questions. Calibration: 32 x 512 tokens of
`calib/wiki-paragraphs.txt` (disjoint from both evaluation sets). Unless a row says otherwise:
per-channel weight scales, static per-tensor activation scales, bf16 model. The `quantize s` and
`eval s` columns are wall times as recorded; the two Table 5 runs overlapped with other jobs on
the 2 cores and their times are inflated (the format sweep and the calibrator runs ran alone).

"""
TABLE5_TEXT = ("Baseline vs int8 vs E4M3 with the recipe of Micikevicius et al. 2022 sec 4.2: "
               "per-channel weights, per-tensor activations, each activation's clip range the "
               "best of max / percentile / MSE by that layer's output error (`--act-calib best`).")
SQUAD_TEXT = ("The same recipe on the extractive-QA MiniLM (fp16 weights, run in bf16; its "
              "README gives EM 54.8 / F1 67.6 on the full held-out split in fp32).")
SWEEP_TEXT = ("Every format under the same recipe (max calibration). What it shows: the 3-bit "
              "mantissa formats (e4m3, e4m3fnuz, hfp8, hif8 in its 3-bit range) cost about 3% word "
              "perplexity, the 2-bit e5m2 ~17%, and static per-tensor int8 nearly triples "
              "perplexity: SmolLM2's activation outliers (amax ~3000 against a median channel "
              "amax of a few units) leave int8 too few levels for the bulk of each tensor, while "
              "a float format's relative precision does not care. e5m2 and e5m2fnuz differ only "
              "below 2^-14 of the scaled range (same max, same normal grid), hence nearly "
              "identical numbers; e4m3fnuz (max 240 = 1.875 x 2^7) lands the amax on a "
              "different mantissa than e4m3 (448 = 1.75 x 2^8).")
CALIB_TEXT = ("What each activation calibrator buys on SmolLM2-135M, whose activations have "
              "large outliers. For FP8 the outliers must be kept: percentile clipping (99.99) "
              "triples perplexity, MSE chooses the max scale, and best-of (which judges by the "
              "layer output) is the only method that beats max for e4m3. For int8 the order "
              "reverses: MSE and best-of clip and help a lot, SmoothQuant helps, the power-of-two "
              "search (whose grid is too coarse for int8) hurts. SmoothQuant (alpha 0.5) does "
              "not help the FP8 formats here; Luo et al.'s gains were on models whose outliers "
              "exceed the format range, which does not happen with per-tensor scales. Costs: "
              "the calibrate+quantize column (same 32 x 512 tokens; max ~14 s).")
TABLE8_TEXT = ("HiF8 direct cast (scale 1 for weights and activations, no calibration), against "
               "the calibrated rows of the calibrator table (`max`, `pow2-search` = Luo et al. "
               "2024 Algorithm 1, `smoothquant`). As in Luo et al. 2024, HiF8's wide range makes "
               "the direct cast usable without any calibration (+4.9% here), and the per-tensor "
               "power-of-two search (Algorithm 1) brings it to +3.2%, slightly better than max "
               "calibration (+3.4%); SmoothQuant does not help on this model.")
FIG2_TEXT = ("No calibration (scale 1): E4M3 with its exponent bias shifted, which moves the "
             "whole representable range by powers of two (bias 3: max 7168; bias 11: max 28); "
             "GEMM inputs only, then GEMM and residual-add inputs (`--quantize-residual`). First "
             "article only. Like Micikevicius et al. 2022 Figure 2, GEMM-only casting works "
             "across a range of biases and fails when the range is too small (bias 11). Unlike "
             "the paper, quantizing the residual stream breaks SmolLM2 at every bias: its "
             "residual stream carries massive activations (thousands) next to small values, and "
             "e4m3 cannot hold both; the paper's models did not have such outliers.")
DIGITS_TEXT = ("A MobileNet-style CNN (BatchNorm, depthwise convolutions) trained on "
               "scikit-learn's digits (seconds on CPU), accuracy on the held-out split, mean of 3 "
               "training seeds. direct = quantized; bn = + BatchNorm re-tuning on 512 unlabeled "
               "images with quantization active; dw = depthwise convolutions kept in high "
               "precision; fl = first and last layer kept.")
SENS_TEXT = ("Each decoder block quantized alone (e4m3), perplexity change on a short WikiText "
             "slice, plus per-module SQNR per format.")


def markers(name: str = "recipes") -> tuple[str, str]:
    """The comments around marked block ``name`` (``BLOCKS``: which page, which script)."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def splice(doc: str, block: str, name: str = "recipes") -> str:
    """``doc`` with the marked block ``name`` replaced by ``block`` (appended when there is
    none)."""
    begin, end = markers(name)
    block = f"{begin}\n{block.strip()}\n{end}"
    if begin in doc and end in doc:
        head, _, rest = doc.partition(begin)
        return head + block + rest.partition(end)[2]
    return doc.rstrip("\n") + "\n\n" + block + "\n"


def kept_blocks(doc: str) -> dict[str, str]:
    """name -> the text inside each marked block of ``doc``: what ``reproduce.py`` carries
    over into the regenerated page (the blocks' rows come from other scripts)."""
    names = re.findall(r"<!-- ([\w-]+):begin -->", doc)
    return {n: doc.partition(markers(n)[0])[2].partition(markers(n)[1])[0].strip()
            for n in names if markers(n)[1] in doc}


def study_args(ap, out: str, block: str) -> None:
    """A study script's ``--assets`` (the offline assets; ``FP8PTQ_ASSETS``), ``--out`` (its
    folder under out/) and ``--doc`` (the page whose ``block`` its section replaces, by
    default the one ``BLOCKS`` names)."""
    ap.add_argument("--assets", default=os.environ.get("FP8PTQ_ASSETS",
                                                       str(ROOT.parent / "shared/assets")))
    ap.add_argument("--out", default=str(ROOT / "out" / out))
    ap.add_argument("--doc", default=str(page_of(block)),
                    help=f"the page whose {block} block the section replaces ('': none)")


def write_section(out: Path, report: dict, text: str, doc: str | None, block: str) -> str:
    """A study's outputs: ``report`` as ``out/report.json``, ``text`` as ``out/section.md`` and
    spliced into ``doc``'s ``block`` (when a doc is given); printed; returned."""
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "section.md").write_text(text)
    if doc:
        Path(doc).write_text(splice(Path(doc).read_text(), text, block))
    print(text)
    return text
