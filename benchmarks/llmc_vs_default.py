"""fp8ptq's default vs llm-compressor's GPTQ FP8_DYNAMIC, SmolLM2 / MiniLM, over seeds.

Same model, same tokens; paired differences per seed.

    python benchmarks/llmc_vs_default.py [smollm2|gemma|minilm] [--schemes FP8_DYNAMIC,FP8_BLOCK]
        [--seeds 0,1,2] [--num-samples 64] [--articles 5] [--questions 3335]
        [--threads 2] [--steps quantize,eval,report] [--tools fp8ptq,llmc]
        [--variant NAME=FLAGS ...] [--out out/llmc-vs-default]
        [--doc docs/results/llm-compressor.md]
        [--llmc-python ~/.cache/fp8ptq-bench/llmc-venv/bin/python] [--assets ../shared/assets]

Installs nothing: llm-compressor is run with ``--llmc-python`` (by default the venv that
``python benchmarks/compare_llmcompressor.py --setup-only`` builds, llm-compressor 0.14.0.1
pinned with ``constraints.txt``); the version it imports is printed and recorded.

Per calibration seed:

1. Calibration windows: fp8ptq's own (``build_calibration_set`` with the default recipe's
   window rule, ``--num-samples`` x 512 tokens of ``calib/wiki-paragraphs.txt``, that seed), as
   token ids. llm-compressor gets them pre-tokenized, so both tools calibrate on the same
   tokens (the sha256 of the ids is in each run's record).
2. Both tools quantize the model (SmolLM2-135M: the GGUF dequantized once to a float32
   folder, the source of both; MiniLM: its SQuAD folder as it is) in a child process each:
   ``fp8ptq quantize SRC --format e4m3 --seed S --num-samples N --dtype float32`` (every other
   field at its default: channel weight scales, dynamic per-token activations, sequential
   GPTQ with act-order) and llm-compressor's ``oneshot`` with ``GPTQModifier(targets="Linear",
   scheme="FP8_DYNAMIC", ignore=["lm_head"])`` (``qa_outputs`` for MiniLM) on the windows.
   ``--schemes FP8_BLOCK`` pairs ``GPTQModifier(scheme="FP8_BLOCK")`` with the default plus
   ``--scheme fp8-block --weight-calib gptq`` (128x128 weight blocks, dynamic 1x128 input
   groups; only where every GEMM's widths are whole 128-blocks, as vLLM requires: MiniLM's
   384 / 1536, not SmolLM2's 576). Recorded: calibrate+quantize seconds (fp8ptq's own
   stage timer; the wall time around ``oneshot`` for llm-compressor), the child's wall time
   and its peak RSS (``ru_maxrss``). ``--threads`` sets each child's torch threads.
   ``--variant NAME=FLAGS`` adds fp8ptq rows with extra quantize flags (one factor at a time)
   at the first seed, ``--variant NAME@0,1,2=FLAGS`` at those seeds (then also pooled).
3. Evaluation: one harness for every folder, ``fp8ptq eval --compare DIR``'s
   (``benchmarks/studies/recipe_study.py``'s cached rows): WikiText-2 test, first ``--articles``
   articles, context 2048, word perplexity (MiniLM: the held-out SQuAD v1.1 split, first
   ``--questions`` questions, F1), both checkpoints loaded as checkpoints (fp8ptq's
   through its fp8ptq.json, llm-compressor's as transformers serves it, activation
   quantization applied in forward), against one unquantized baseline (float32).
4. Report: each delta with its paired bootstrap 95% interval against the baseline, and the
   paired difference fp8ptq minus llm-compressor (percent of llm-compressor's perplexity,
   the same articles resampled for both; F1 points for SQuAD, questions resampled): an
   interval entirely below zero (above zero for F1) is "strictly better". Written to
   ``--out/report.json`` and ``section.md`` and spliced into ``--doc``'s ``llmc-compare``
   block (``llmc-compare-minilm`` for MiniLM).

Steps are cached (folders, ``*.json`` rows), so a stopped run resumes; ``--steps`` and
``--tools`` split the work across processes (e.g. one quantizing while another evaluates).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks/studies"))  # recipe_study's harness

import compare_llmcompressor as cl  # noqa: E402
from recipe_study import MODELS, records_from_json, records_to_json, run_one  # noqa: E402
from results_page import study_args, write_section  # noqa: E402

from fp8ptq.config.recipe import Recipe  # noqa: E402
from fp8ptq.evals import report  # noqa: E402
from fp8ptq.evals.stats import Records, paired_interval  # noqa: E402
from fp8ptq.execution import job  # noqa: E402
from fp8ptq.io.data import build_calibration_set  # noqa: E402
from fp8ptq.io.loading import gguf_folder  # noqa: E402

# llm-compressor scheme -> (its GPTQ recipe, fp8ptq's flags on top of the default, row tag)
SCHEMES = {"FP8_DYNAMIC": ("GPTQ-FP8_DYNAMIC", [], ""),
           "FP8_BLOCK": ("GPTQ-FP8_BLOCK", ["--scheme", "fp8-block", "--weight-calib", "gptq"],
                         "block-")}
# quantize flags that choose other calibration windows than llm-compressor is handed
WINDOW_FLAGS = ("--num-samples", "--seq-len", "--calib-windows")


@dataclass(frozen=True)
class Score:
    """What a model is scored by: the task, its metric, and which way is better. Perplexity
    differences are in percent of llm-compressor's; F1 differences in points."""
    task: str
    metric: str  # "task.name", a key of a row's metrics
    lower_is_better: bool
    model: str  # the protocol's sentence on the model
    data: str  # ... and on the evaluation slice (formatted with the row count)
    title: str = ""  # added to the section's heading ("" for SmolLM2, the first study)

    @property
    def unit(self) -> str:
        return "%" if self.lower_is_better else " pts"

    def strict(self, ci) -> bool:
        """The paired interval of fp8ptq minus llm-compressor lies wholly on the better side."""
        return bool(ci) and (ci[1] < 0 if self.lower_is_better else ci[0] > 0)


SCORES = {
    "smollm2": Score("wikitext", "wikitext.word_perplexity", True,
                     "SmolLM2-135M (Q4_1 GGUF dequantized to a float32 folder, the source of "
                     "both tools; float32 throughout)",
                     "WikiText-2 test, articles {first}-{last}, context 2048, word perplexity"),
    "gemma": Score("wikitext", "wikitext.word_perplexity", True,
                   "gemma-3-270m (Q4_K_M GGUF of `fetch-gemma-270m.sh` dequantized to a float32 "
                   "folder, the source of both tools; float32 throughout)",
                   "WikiText-2 test, articles {first}-{last}, context 2048, word perplexity",
                   ": gemma-3-270m"),
    "minilm": Score("squad", "squad.f1", False,
                    "MiniLM fine-tuned for SQuAD (float32 folder, the source of both tools)",
                    "SQuAD v1.1 held-out split, questions {first}-{last}, F1", ": MiniLM SQuAD"),
}
SCORE = SCORES["smollm2"]


def windows_file(src: Path, calib: Path, n: int, seed: int, out: Path) -> Path:
    """The default recipe's calibration windows for ``seed`` as token ids (what fp8ptq's job
    builds for ``--num-samples n --seed seed``), for llm-compressor's child."""
    path = out / f"windows-{n}x512-seed{seed}.json"
    if not path.exists():
        from transformers import AutoTokenizer
        rule = Recipe()
        windows = build_calibration_set(job.calibration_texts(Recipe(calib_data=str(calib))),
                                        AutoTokenizer.from_pretrained(src), num_samples=n,
                                        seq_len=512, seed=seed, source=str(calib),
                                        windows=rule.calib_windows)
        path.write_text(json.dumps({"sha256": windows.sha256, "windows": rule.calib_windows,
                                    "input_ids": windows.input_ids.tolist()}))
    return path


def article_slice(data: Path, first: int, n: int, out: Path) -> tuple[str, Path]:
    """Articles ``first`` .. ``first + n - 1`` (1-based) of the raw WikiText file ``data``,
    written beside the cache as a raw file of their own (the assets stay where they are), and
    the folder their scores are cached in."""
    from fp8ptq.evals.wikitext import split_articles
    scores = out.with_name(f"{out.name}-from-{first}")
    scores.mkdir(exist_ok=True)
    path = scores / f"wikitext-articles-{first}-{first + n - 1}.raw"
    articles = split_articles(data.read_text(encoding="utf-8"))[first - 1:first - 1 + n]
    path.write_text("".join(articles), encoding="utf-8")
    return str(path), scores


def child_env(threads: int) -> dict:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads)}


def quantize_llmc(py: Path, src: Path, windows: Path, n: int, dest: Path, threads: int,
                  scheme: str = "GPTQ-FP8_DYNAMIC", task: str = "causal-lm") -> dict:
    return cl.llmc_child(py, src, scheme, dest, windows, n, task, env=child_env(threads),
                         after=lambda: {"threads": threads, "load_after": os.getloadavg()})


def quantize_fp8ptq(src: Path, calib: Path, n: int, seed: int, dest: Path, flags: list[str],
                    threads: int) -> dict:
    facts_file = dest.with_name(dest.name + ".quantize.json")
    if not facts_file.exists():
        cmd = [str(Path(sys.executable).parent / "fp8ptq"), "quantize", str(src), "-o",
               str(dest), "--force", "--format", "e4m3", "--calib-data", str(calib),
               "--num-samples", str(n), "--seed", str(seed), "--dtype", "float32", *flags,
               "--json"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, check=True, capture_output=True, text=True,
                              env=child_env(threads))
        wall = time.perf_counter() - t0
        rep = json.loads(done.stdout)
        seconds = rep["seconds"]
        cq = seconds.get("calibrate+quantize", 0.0)
        facts_file.write_text(json.dumps({
            "flags": flags, "wall_seconds": wall, "peak_rss_mb": rep["peak_rss_mb"],
            "seconds": seconds, "calibrate_quantize_seconds":
                sum(cq.values()) if isinstance(cq, dict) else float(cq),
            "threads": threads, "load_after": os.getloadavg(), "command": cmd[1:]}, indent=1))
    return json.loads(facts_file.read_text())


def parse_variant(spec: str, first_seed: int) -> tuple[str, set[int], str]:
    """``NAME=FLAGS`` (run at the first seed) or ``NAME@S1,S2=FLAGS`` (at those seeds) ->
    (name, seeds, flags)."""
    head, flags = spec.split("=", 1)
    name, _, at = head.partition("@")
    return name, {int(s) for s in at.split(",")} if at else {first_seed}, flags


def paired_diff(ours: dict, theirs: dict, score: Score = SCORE
                ) -> tuple[float, list[float] | None]:
    """fp8ptq minus llm-compressor with its paired 95% interval: in percent of
    llm-compressor's perplexity, or in points of F1."""
    iv = paired_interval(records_from_json(theirs["records"])[score.task],
                         records_from_json(ours["records"])[score.task],
                         score.metric.partition(".")[2])
    a, b = ours["metrics"][score.metric], theirs["metrics"][score.metric]
    if score.lower_is_better:
        return 100 * (a / b - 1), iv and iv["pct_ci95"]
    return a - b, iv and iv["ci95"]


def _span(d: float, ci, unit: str) -> str:
    return f"{d:+.2f}{unit}" + (f" ({ci[0]:+.2f}..{ci[1]:+.2f})" if ci else "")


def _threads(facts: dict) -> str:
    """The torch threads the rows' quantize children ran with, from their own records (a
    cached row keeps the count of the run that made it)."""
    used = sorted({f["threads"] for f in facts.values() if f and f.get("threads")})
    return " or ".join(map(str, used)) + (" (each row's in its record)" if len(used) > 1
                                          else "")


def section(rows: list[dict], by_name: dict, facts: dict, args, meta: dict,
            score: Score = SCORE) -> str:
    base = by_name["baseline"]
    pairs = [(f, facts[f["against"]]) for f in facts.values() if f.get("against")]
    # rows whose flags choose other windows (--num-samples, --seq-len, --calib-windows)
    # calibrate on other tokens by design; every other row must match llm-compressor's
    other = sorted({a["label"] for a, b in pairs
                    if a.get("windows_sha256") != b.get("windows_sha256")})
    moved = [x for x in other if not any(f in x for f in WINDOW_FLAGS)]
    windows = ("agrees at every seed" if not other else
               "DIFFERS for " + ", ".join(moved) if moved else
               "agrees at every seed except for the rows whose flags choose other windows")
    schemes, first, model = args.schemes.split(","), args.first_article, args.model
    count = args.articles if score.lower_is_better else args.questions
    ppl = score.lower_is_better
    lines = [
        "## fp8ptq's default recipe against llm-compressor's GPTQ " + " and ".join(schemes)
        + score.title
        + ("" if first == 1 else f": selection slice (articles {first}-{first + count - 1})"),
        "",
        "Generated by `python benchmarks/llmc_vs_default.py "
        + ("" if model == "smollm2" else f"{model} ")
        + ("" if schemes == ["FP8_DYNAMIC"] else f"--schemes {','.join(schemes)} ")
        + f"--seeds {args.seeds} --num-samples {args.num_samples} "
        + (f"--articles {args.articles} " if ppl else f"--questions {args.questions} ")
        + ("" if first == 1 else f"--first-article {first} ")
        + f"--threads {args.threads}" + "".join(f" --variant '{v}'" for v in args.variant)
        + (" --note ..." if args.note else "")
        + "`.", "",
        f"Model {score.model}, "
        + score.data.format(first=first, last=first + count - 1) + ", every folder scored by "
        "`fp8ptq eval --compare DIR`'s harness against one unquantized baseline. fp8ptq: "
        f"`fp8ptq quantize SRC --format e4m3 --num-samples {args.num_samples} --seed S "
        "--dtype float32` (the default recipe: channel weight scales, dynamic per-token "
        "activations, sequential GPTQ with act-order, document windows"
        + ("" if schemes == ["FP8_DYNAMIC"] else
           "; the `FP8_BLOCK` rows add `--scheme fp8-block --weight-calib gptq`: 128x128 "
           "weight blocks, dynamic 1x128 input groups, the same GPTQ") + "). llm-compressor: "
        "`oneshot` with `GPTQModifier(targets=\"Linear\", scheme=S, ignore=[\""
        + ("lm_head" if ppl else "qa_outputs") + "\"])`, S " + " / ".join(schemes)
        + ", given fp8ptq's own calibration "
        f"windows for that seed ({args.num_samples} x 512 token ids; the sha256 of the ids "
        f"recorded by both runs {windows}), "
        f"{meta['llmc']}; fp8ptq {meta['fp8ptq']}. Machine: {platform.machine()} "
        f"{os.cpu_count()} cores, shared with "
        f"other jobs; {_threads(facts)} torch thread(s) per child; report written "
        f"{meta['written']} at load average {meta['load']} (load after each quantize child in "
        "the row). Seconds: calibrate+quantize (fp8ptq's stage timer; the wall time of "
        "`oneshot` for llm-compressor), and in parentheses the whole child (load, quantize, "
        "save); peak RSS: the child's `ru_maxrss`." + (f" {args.note}" if args.note else ""),
        "",
        f"Baseline: {base['metrics'][score.metric]:.3f}. Delta: "
        + ("relative word perplexity" if ppl else "F1 points") + " against it, "
        "paired bootstrap 95% interval over the " + ("articles" if ppl else "questions")
        + ". fp8ptq - llmc: the paired difference "
        + ("in percent of llm-compressor's perplexity" if ppl else "in F1 points")
        + "; strictly better when its interval lies entirely "
        + ("below" if ppl else "above") + " zero.", "",
        "| seed | tool | " + ("word ppl" if ppl else "F1") + " | delta (95% CI) | "
        "fp8ptq - llmc (95% CI) | quantize s | peak RSS MB | load |",
        "|---|---|---|---|---|---|---|---|"]
    for name in [r["name"] for r in rows[1:]]:
        v, f = by_name[name], facts[name]
        if ppl:
            lo, hi = v["deltas_pct_ci95"][score.metric]
            delta = f"{v['deltas_pct'][score.metric]:+.2f}% ({lo:+.2f}..{hi:+.2f})"
        else:
            lo, hi = v["deltas_ci95"][score.metric]
            delta = f"{v['deltas'][score.metric]:+.2f} ({lo:+.2f}..{hi:+.2f})"
        cell = "-"
        if f.get("against"):
            d, ci = paired_diff(f["row"], facts[f["against"]]["row"], score)
            cell = _span(d, ci, "%" if ppl else "")
            if score.strict(ci):
                cell = f"**{cell}**"
        load = ", ".join(f"{x:.1f}" for x in f["load_after"])
        lines.append(f"| {f['seed']} | {f['label']} | {v['metrics'][score.metric]:.3f} | "
                     f"{delta} | {cell} | "
                     f"{f['cq']:.0f} ({f['wall']:.0f}) | {f['rss']:.0f} | {load} |")
    lines.append("")
    for scheme in schemes:
        of = {k: f for k, f in facts.items() if f.get("scheme", "FP8_DYNAMIC") == scheme}
        lines += summary_lines(of, score, "" if len(schemes) == 1 else f"{scheme}: ")
    return "\n".join(lines).rstrip() + "\n"


def pooled(rows: list[dict], score: Score = SCORE) -> dict:
    """One row whose per-sample columns are the means of ``rows``' (same articles or
    questions): its metric is the seeds' pooled one (perplexity from the summed
    log-likelihoods and words; F1 the mean over seeds), and its samples still pair with
    another pool's."""
    recs = [records_from_json(r["records"])[score.task] for r in rows]
    first = recs[0]
    summed = Records(first.ids, {k: sum(r.columns[k] for r in recs) / len(recs)
                                 for k in first.columns}, first.formulas, first.scale)
    metric = score.metric.partition(".")[2]
    return {"metrics": {score.metric: float(summed.metric(metric))},
            "records": {score.task: records_to_json({score.task: summed})[score.task]}}


def summary_lines(facts: dict, score: Score = SCORE, lead: str = "") -> list[str]:
    """Per seed, whether the default is strictly better; each variant against the default of
    its seed (paired: in percent of the default's perplexity, or F1 points)."""
    default = {f["seed"]: f for f in facts.values() if f.get("against") and not f.get("flags")}
    if not default:
        return []
    unit = score.unit
    wins = [s for s, f in default.items()
            if score.strict(paired_diff(f["row"], facts[f["against"]]["row"], score)[1])]
    side = "below" if score.lower_is_better else "above"
    out = [f"{lead}The default strictly better (paired interval {side} zero) at {len(wins)} of "
           f"{len(default)} seed(s)" + (f" ({', '.join(map(str, sorted(wins)))})" if wins
                                       else "") + "."]
    if len(default) > 1:
        ours = pooled([f["row"] for f in default.values()], score)
        theirs = pooled([facts[f["against"]]["row"] for f in default.values()], score)
        d, ci = paired_diff(ours, theirs, score)
        each = ", ".join(f"{paired_diff(f['row'], facts[f['against']]['row'], score)[0]:+.2f}"
                         for _, f in sorted(default.items()))
        out.append(f"{lead}Pooled over seeds {', '.join(map(str, sorted(default)))} (each "
                   + ("article's log-likelihood and words summed" if score.lower_is_better
                      else "question's F1 averaged")
                   + " over the seeds, "
                   + ("articles" if score.lower_is_better else "questions") + " resampled): "
                   f"fp8ptq - llmc {_span(d, ci, unit)}; per seed {each}; the seeds themselves "
                   "are not resampled, so the interval holds the samples' noise only.")
    variants = [f for f in facts.values() if f.get("flags") and f["seed"] in default]
    for f in variants:
        base = _base_variant(f, variants)
        against = default[f["seed"]] if base is None else base
        d, ci = paired_diff(f["row"], against["row"], score)
        what = "the default" if base is None else f"`{' '.join(base['flags'])}`"
        out.append(f"{lead}`{' '.join(f['flags'])}` against {what}, seed {f['seed']}: "
                   f"{_span(d, ci, unit)}.")
    return out + [lead + x for x in pooled_variant_lines(facts, default, score)]


def _base_variant(f: dict, variants: list[dict]) -> dict | None:
    """The variant of the same seed whose flags ``f``'s extend (one more factor on top of
    it), the longest such; None: ``f`` is one factor on top of the default."""
    bases = [g for g in variants if g["seed"] == f["seed"] and len(g["flags"]) < len(f["flags"])
             and f["flags"][:len(g["flags"])] == g["flags"]]
    return max(bases, key=lambda g: len(g["flags"]), default=None)


def pooled_variant_lines(facts: dict, default: dict, score: Score = SCORE) -> list[str]:
    """A variant measured at two or more seeds, pooled as the default is: against
    llm-compressor and against the default of the same seeds."""
    by_flags: dict[tuple, list[dict]] = {}
    for f in facts.values():
        if f.get("flags") and f["seed"] in default:
            by_flags.setdefault(tuple(f["flags"]), []).append(f)
    out = []
    for flags, fs in by_flags.items():
        if len(fs) < 2:
            continue
        seeds = sorted(f["seed"] for f in fs)
        ours = pooled([f["row"] for f in fs], score)
        cells = []
        for label, others in (("llmc", [facts[f["against"]]["row"] for f in fs]),
                              ("the default", [default[f["seed"]]["row"] for f in fs])):
            d, ci = paired_diff(ours, pooled(others, score), score)
            cells.append(f"minus {label} {_span(d, ci, score.unit)}")
        out.append(f"`{' '.join(flags)}` pooled over seeds {', '.join(map(str, seeds))}: "
                   + "; ".join(cells) + ".")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(SCORES), nargs="?", default="smollm2")
    study_args(ap, "llmc-vs-default", "llmc-compare")
    ap.add_argument("--schemes", default="FP8_DYNAMIC",
                    help="llm-compressor GPTQ schemes to pair: FP8_DYNAMIC (with fp8ptq's "
                         "default), FP8_BLOCK (with the default + --scheme fp8-block "
                         "--weight-calib gptq)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--articles", type=int, default=5)
    ap.add_argument("--questions", type=int, default=3335, help="SQuAD questions (minilm)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    ap.add_argument("--steps", default="quantize,eval,report")
    ap.add_argument("--tools", default="fp8ptq,llmc")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=FLAGS: an fp8ptq row with extra quantize flags, e.g. "
                         "'damp10=--gptq-damp 0.1', at the first seed; NAME@0,1,2=FLAGS: at "
                         "those seeds (pooled over them in the summary)")
    ap.add_argument("--llmc-python", default=str(cl.VENV / "bin/python"))
    ap.add_argument("--note", default="", help="a sentence added to the protocol (how it ran)")
    ap.add_argument("--first-article", type=int, default=1,
                    help="score --articles articles from this one (1-based) of the test split: "
                         "a selection slice disjoint from the report's first articles; its "
                         "scores are cached under --out/smollm2-5-from-K (the checkpoints "
                         "are the ones in --out/smollm2-5)")
    return ap


def main(argv=None) -> str | None:
    args = parser().parse_args(argv)
    score = SCORES[args.model]
    schemes = [x for x in args.schemes.split(",") if x]
    unknown = [x for x in schemes if x not in SCHEMES]
    if unknown:
        raise SystemExit(f"error: unknown scheme(s) {', '.join(unknown)}; known: "
                         f"{', '.join(SCHEMES)}")
    if args.first_article != 1 and args.model != "smollm2":
        raise SystemExit("error: --first-article is for WikiText (smollm2) only")
    steps, tools = set(args.steps.split(",")), set(args.tools.split(","))
    import torch
    torch.set_num_threads(args.threads)
    assets = Path(args.assets).resolve()
    limit = args.articles if score.lower_is_better else args.questions
    out = Path(args.out).resolve() / f"{args.model}-{limit}"
    out.mkdir(parents=True, exist_ok=True)
    calib = assets / "calib/wiki-paragraphs.txt"
    py = Path(args.llmc_python)
    llmc = cl.llmc_version(py) if "llmc" in tools or "report" in steps else ""
    spec = MODELS[args.model]
    src = assets / spec["spec"]
    if args.model == "smollm2":  # transformers' own dequantizing, as first measured
        src = cl.hf_folder(src, Path(args.out).resolve() / "smollm2-hf")
    elif src.suffix == ".gguf":  # fp8ptq's cached float32 folder of it
        src = gguf_folder(src)
    if llmc:
        print(f"running {llmc} from {py}", flush=True)
    seeds = [int(x) for x in args.seeds.split(",")]
    variants = [parse_variant(v, seeds[0]) for v in args.variant]
    n = args.num_samples
    # rows: (name, tool, seed, flags, against, scheme); flags: the variant's, on top of the
    # scheme's own (SCHEMES)
    plan = []
    for scheme in schemes:
        tag = SCHEMES[scheme][2]
        for x in seeds:
            row = f"{tag}n{n}-seed{x}"
            plan.append((f"llmc-{row}", "llmc", x, None, None, scheme))
            plan.append((f"fp8ptq-{row}", "fp8ptq", x, [], f"llmc-{row}", scheme))
            plan += [(f"fp8ptq-{k}-{row}", "fp8ptq", x, f.split(), f"llmc-{row}", scheme)
                     for k, at, f in variants if x in at]
    plan = [p for p in plan if p[1] in tools] if "report" not in steps else plan
    task = "causal-lm" if score.lower_is_better else "qa"
    facts = {}
    if "quantize" in steps:
        for name, tool, x, flags, _, scheme in plan:
            dest = out / name
            t0 = time.strftime("%H:%M", time.gmtime())
            if tool == "llmc":
                w = windows_file(src, calib, n, x, out)
                f = quantize_llmc(py, src, w, n, dest, args.threads, SCHEMES[scheme][0], task)
                print(f"{name} (from {t0}): oneshot {f.get('oneshot_seconds', 0):.0f} s, "
                      f"child {f['wall_seconds']:.0f} s, {f['peak_rss_mb']:.0f} MB", flush=True)
            else:
                f = quantize_fp8ptq(src, calib, n, x, dest, SCHEMES[scheme][1] + flags,
                                    args.threads)
                print(f"{name} (from {t0}): calibrate+quantize "
                      f"{f['calibrate_quantize_seconds']:.0f} s, child {f['wall_seconds']:.0f}"
                      f" s, {f['peak_rss_mb']:.0f} MB", flush=True)
    if not steps & {"eval", "report"}:
        return None
    base = Recipe(calib_data=str(calib), dtype="float32")
    eval_data, scores = str(assets / spec["data"]), out
    if args.first_article != 1:
        eval_data, scores = article_slice(Path(eval_data), args.first_article, args.articles, out)
    eval_kwargs = {"data": {score.task: eval_data},
                   "limit": limit, "seq_len": spec["seq_len"], "batch_size": None}
    texts = job.calibration_texts(base, str(src))
    docs = [run_one("baseline", None, str(src), base, texts, score.task, eval_kwargs, scores)]
    for name, tool, x, flags, against, scheme in plan:
        dest = out / name
        if not dest.exists():
            print(f"{name}: not quantized yet, skipped", flush=True)
            continue
        doc = run_one(name, {}, str(src), base, texts, score.task, eval_kwargs, scores,
                      checkpoint=str(dest))
        docs.append(doc)
        print(f"{name}: {doc['metrics'][score.metric]:.3f} ({doc['wall_seconds']:.0f} s)",
              flush=True)
        what = "" if scheme == "FP8_DYNAMIC" else f" `{scheme}`"
        if tool == "llmc":
            f = json.loads((dest / "llmc_run.json").read_text())
            facts[name] = {"label": "llm-compressor" + what,
                           "cq": f.get("oneshot_seconds", 0.0),
                           "wall": f["wall_seconds"], "rss": f["peak_rss_mb"],
                           "load_after": f["load_after"], "version": f["llmcompressor"],
                           "windows_sha256": f["windows_sha256"], "threads": f.get("threads")}
        else:
            f = json.loads(dest.with_name(dest.name + ".quantize.json").read_text())
            label = "fp8ptq default" + (f" + `{' '.join(SCHEMES[scheme][1])}`" if what else "")
            label += f" `{' '.join(flags)}`" if flags else ""
            calib_meta = json.loads((dest / "fp8ptq.json").read_text())["calibration"]
            facts[name] = {"label": label, "cq": f["calibrate_quantize_seconds"],
                           "wall": f["wall_seconds"], "rss": f["peak_rss_mb"],
                           "load_after": f["load_after"], "flags": flags,
                           "windows_sha256": calib_meta["sha256"], "threads": f.get("threads")}
        facts[name].update(seed=x, row=doc, scheme=scheme,
                           against=against if against in facts else None)
    if "report" not in steps:
        return None
    rows = [{**d, "records": records_from_json(d["records"])} for d in docs]
    report.attach_intervals(rows)
    report_doc = report.to_json(rows, docs[0]["protocol"], base.to_dict())
    by_name = {v["name"]: v for v in report_doc["variants"]}
    import transformers

    import fp8ptq
    meta = {"fp8ptq": f"{getattr(fp8ptq, '__version__', '?')} (torch {torch.__version__}, "
                      f"transformers {transformers.__version__})",
            "llmc": llmc, "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load": ", ".join(f"{x:.1f}" for x in os.getloadavg())}
    text = section(docs, by_name, facts, args, meta, score)
    summary = {k: {kk: vv for kk, vv in f.items() if kk != "row"} for k, f in facts.items()}
    for k, f in facts.items():
        if f.get("against"):
            d, ci = paired_diff(f["row"], facts[f["against"]]["row"], score)
            summary[k]["minus_llmc"], summary[k]["minus_llmc_ci95"] = d, ci
            summary[k]["minus_llmc_unit"] = score.unit.strip()
    block = ("llmc-compare" + ("" if args.model == "smollm2" else f"-{args.model}")
             + ("" if args.first_article == 1 else "-selection"))
    return write_section(scores, {"llmcompressor": llmc, "rows": summary, "report": report_doc},
                         text, args.doc, block)


if __name__ == "__main__":
    main()
