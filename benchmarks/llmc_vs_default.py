"""fp8ptq's default recipe against llm-compressor's GPTQ ``FP8_DYNAMIC``: same model, same tokens.

    python benchmarks/llmc_vs_default.py [--seeds 0,1,2] [--num-samples 64] [--articles 5]
        [--threads 2] [--steps quantize,eval,report] [--tools fp8ptq,llmc]
        [--variant NAME=FLAGS ...] [--out out/llmc-vs-default] [--doc docs/results.md]
        [--llmc-python ~/.cache/fp8ptq-bench/llmc-venv/bin/python] [--assets ../shared/assets]

Installs nothing: llm-compressor is run with ``--llmc-python`` (by default the venv that
``python benchmarks/compare_llmcompressor.py --setup-only`` builds, llm-compressor 0.14.0.1
pinned with ``constraints.txt``); the version it imports is printed and recorded.

Per calibration seed:

1. Calibration windows: fp8ptq's own (``build_calibration_set`` with the default recipe's
   window rule, ``--num-samples`` x 512 tokens of ``calib/wiki-paragraphs.txt``, that seed), as
   token ids. llm-compressor gets them pre-tokenized, so both tools calibrate on the same
   tokens (the sha256 of the ids is in each run's record).
2. Both tools quantize SmolLM2-135M (the GGUF dequantized once to a float32 folder, the
   source of both) in a child process each: ``fp8ptq quantize SRC --format e4m3 --seed S
   --num-samples N --dtype float32`` (every other field at its default: channel weight
   scales, dynamic per-token activations, sequential GPTQ with act-order) and
   llm-compressor's ``oneshot`` with ``GPTQModifier(targets="Linear", scheme="FP8_DYNAMIC",
   ignore=["lm_head"])`` on the windows. Recorded: calibrate+quantize seconds (fp8ptq's own
   stage timer; the wall time around ``oneshot`` for llm-compressor), the child's wall time
   and its peak RSS (``ru_maxrss``). ``--threads`` sets each child's torch threads.
   ``--variant NAME=FLAGS`` adds fp8ptq rows with extra quantize flags (one factor at a time)
   at the first seed, ``--variant NAME@0,1,2=FLAGS`` at those seeds (then also pooled).
3. Evaluation: one harness for every folder, ``fp8ptq eval --compare DIR``'s
   (``benchmarks/recipe_study.py``'s cached rows): WikiText-2 test, first ``--articles``
   articles, context 2048, word perplexity, both checkpoints loaded as checkpoints (fp8ptq's
   through its fp8ptq.json, llm-compressor's as transformers serves it, activation
   quantization applied in forward), against one unquantized baseline (float32).
4. Report: each delta with its paired bootstrap 95% interval against the baseline, and the
   paired difference fp8ptq minus llm-compressor (percent of llm-compressor's perplexity,
   the same articles resampled for both): an interval entirely below zero is "strictly
   better". Written to ``--out/report.json`` and ``section.md`` and spliced into ``--doc``'s
   ``llmc-compare`` block.

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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_llmcompressor as cl  # noqa: E402
from recipe_study import MODELS, records_from_json, records_to_json, run_one  # noqa: E402
from results_page import study_args, write_section  # noqa: E402

from fp8ptq.config.recipe import Recipe  # noqa: E402
from fp8ptq.evals import report  # noqa: E402
from fp8ptq.evals.stats import Records, paired_interval  # noqa: E402
from fp8ptq.execution import job  # noqa: E402
from fp8ptq.io.data import build_calibration_set  # noqa: E402

SCHEME = "GPTQ-FP8_DYNAMIC"
# quantize flags that choose other calibration windows than llm-compressor is handed
WINDOW_FLAGS = ("--num-samples", "--seq-len", "--calib-windows")
METRIC = "wikitext.word_perplexity"
TASK = "wikitext"


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


def quantize_llmc(py: Path, src: Path, windows: Path, n: int, dest: Path, threads: int) -> dict:
    facts_file = dest / "llmc_run.json"
    if not facts_file.exists():
        t0 = time.perf_counter()
        subprocess.run([str(py), "-c", cl.CHILD, str(src), SCHEME, str(dest), str(windows),
                        str(n), "512", "causal-lm"], check=True, env=child_env(threads))
        facts = json.loads(facts_file.read_text())
        facts.update(wall_seconds=time.perf_counter() - t0, threads=threads,
                     windows_sha256=json.loads(windows.read_text())["sha256"],
                     load_after=os.getloadavg())
        facts_file.write_text(json.dumps(facts, indent=1))
    return json.loads(facts_file.read_text())


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


def paired_diff(ours: dict, theirs: dict) -> tuple[float, list[float] | None]:
    """fp8ptq minus llm-compressor in percent of llm-compressor's perplexity, paired 95% CI."""
    iv = paired_interval(records_from_json(theirs["records"])[TASK],
                         records_from_json(ours["records"])[TASK], METRIC.partition(".")[2])
    a, b = ours["metrics"][METRIC], theirs["metrics"][METRIC]
    return 100 * (a / b - 1), iv and iv["pct_ci95"]


def section(rows: list[dict], by_name: dict, facts: dict, args, meta: dict) -> str:
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
    lines = [
        "## fp8ptq's default recipe against llm-compressor's GPTQ FP8_DYNAMIC"
        + ("" if args.first_article == 1 else
           f": selection slice (articles {args.first_article}-"
           f"{args.first_article + args.articles - 1})"), "",
        "Generated by `python benchmarks/llmc_vs_default.py "
        f"--seeds {args.seeds} --num-samples {args.num_samples} --articles {args.articles} "
        + ("" if args.first_article == 1 else f"--first-article {args.first_article} ")
        + f"--threads {args.threads}" + "".join(f" --variant '{v}'" for v in args.variant)
        + (" --note ..." if args.note else "")
        + "`.", "",
        "Model SmolLM2-135M (Q4_1 GGUF dequantized to a float32 folder, the source of both "
        "tools; float32 throughout), "
        + f"WikiText-2 test, articles {args.first_article}-"
        f"{args.first_article + args.articles - 1}, "
        "context 2048, word perplexity, every folder scored by `fp8ptq eval --compare DIR`'s "
        "harness against one unquantized baseline. fp8ptq: `fp8ptq quantize SRC --format e4m3 "
        f"--num-samples {args.num_samples} --seed S --dtype float32` (the default recipe: "
        "channel weight scales, dynamic per-token activations, sequential GPTQ with act-order, "
        "document windows). llm-compressor: `oneshot` with `GPTQModifier(targets=\"Linear\", "
        "scheme=\"FP8_DYNAMIC\", ignore=[\"lm_head\"])`, given fp8ptq's own calibration "
        f"windows for that seed ({args.num_samples} x 512 token ids; the sha256 of the ids "
        f"recorded by both runs {windows}), "
        f"{meta['llmc']}; fp8ptq {meta['fp8ptq']}. Machine: {platform.machine()} "
        f"{os.cpu_count()} cores, shared with "
        f"other jobs; {args.threads} torch thread(s) per child; report written "
        f"{meta['written']} at load average {meta['load']} (load after each quantize child in "
        "the row). Seconds: calibrate+quantize (fp8ptq's stage timer; the wall time of "
        "`oneshot` for llm-compressor), and in parentheses the whole child (load, quantize, "
        "save); peak RSS: the child's `ru_maxrss`." + (f" {args.note}" if args.note else ""),
        "",
        f"Baseline: {base['metrics'][METRIC]:.3f}. Delta: relative word perplexity against it, "
        "paired bootstrap 95% interval over the articles. fp8ptq - llmc: the paired "
        "difference in percent of llm-compressor's perplexity; strictly better when its "
        "interval lies entirely below zero.", "",
        "| seed | tool | word ppl | delta (95% CI) | fp8ptq - llmc (95% CI) | quantize s | "
        "peak RSS MB | load |",
        "|---|---|---|---|---|---|---|---|"]
    for name in [r["name"] for r in rows[1:]]:
        v, f = by_name[name], facts[name]
        lo, hi = v["deltas_pct_ci95"][METRIC]
        cell = "-"
        if f.get("against"):
            d, ci = paired_diff(f["row"], facts[f["against"]]["row"])
            cell = f"{d:+.2f}% ({ci[0]:+.2f}..{ci[1]:+.2f})" if ci else f"{d:+.2f}%"
            if ci and ci[1] < 0:
                cell = f"**{cell}**"
        load = ", ".join(f"{x:.1f}" for x in f["load_after"])
        lines.append(f"| {f['seed']} | {f['label']} | {v['metrics'][METRIC]:.3f} | "
                     f"{v['deltas_pct'][METRIC]:+.2f}% ({lo:+.2f}..{hi:+.2f}) | {cell} | "
                     f"{f['cq']:.0f} ({f['wall']:.0f}) | {f['rss']:.0f} | {load} |")
    lines += ["", *summary_lines(facts)]
    return "\n".join(lines).rstrip() + "\n"


def pooled(rows: list[dict]) -> dict:
    """One row whose per-article columns are the sums of ``rows``' (same articles): its
    perplexity is the seeds' pooled one, and its articles still pair with another pool's."""
    recs = [records_from_json(r["records"])[TASK] for r in rows]
    first = recs[0]
    summed = Records(first.ids, {k: sum(r.columns[k] for r in recs) for k in first.columns},
                     first.formulas, first.scale)
    metric = METRIC.partition(".")[2]
    return {"metrics": {METRIC: float(summed.metric(metric))},
            "records": {TASK: records_to_json({TASK: summed})[TASK]}}


def summary_lines(facts: dict) -> list[str]:
    """Per seed, whether the default is strictly better; each variant against the default of
    its seed (paired, in percent of the default's perplexity)."""
    default = {f["seed"]: f for f in facts.values() if f.get("against") and not f.get("flags")}
    if not default:
        return []
    wins = [s for s, f in default.items()
            if (paired_diff(f["row"], facts[f["against"]]["row"])[1] or [0, 0])[1] < 0]
    out = [f"The default strictly better (paired interval below zero) at {len(wins)} of "
           f"{len(default)} seed(s)" + (f" ({', '.join(map(str, sorted(wins)))})" if wins
                                       else "") + "."]
    if len(default) > 1:
        ours = pooled([f["row"] for f in default.values()])
        theirs = pooled([facts[f["against"]]["row"] for f in default.values()])
        d, ci = paired_diff(ours, theirs)
        span = f" ({ci[0]:+.2f}..{ci[1]:+.2f})" if ci else ""
        out.append(f"Pooled over seeds {', '.join(map(str, sorted(default)))} (each article's "
                   f"log-likelihood and words summed over the seeds, articles resampled): "
                   f"fp8ptq - llmc {d:+.2f}%{span}; the seeds themselves are not resampled, "
                   "so the interval holds the articles' noise only.")
    variants = [f for f in facts.values() if f.get("flags") and f["seed"] in default]
    for f in variants:
        base = _base_variant(f, variants)
        against = default[f["seed"]] if base is None else base
        d, ci = paired_diff(f["row"], against["row"])
        span = f" ({ci[0]:+.2f}..{ci[1]:+.2f})" if ci else ""
        what = "the default" if base is None else f"`{' '.join(base['flags'])}`"
        out.append(f"`{' '.join(f['flags'])}` against {what}, seed {f['seed']}: {d:+.2f}%{span}.")
    return out + pooled_variant_lines(facts, default)


def _base_variant(f: dict, variants: list[dict]) -> dict | None:
    """The variant of the same seed whose flags ``f``'s extend (one more factor on top of
    it), the longest such; None: ``f`` is one factor on top of the default."""
    bases = [g for g in variants if g["seed"] == f["seed"] and len(g["flags"]) < len(f["flags"])
             and f["flags"][:len(g["flags"])] == g["flags"]]
    return max(bases, key=lambda g: len(g["flags"]), default=None)


def pooled_variant_lines(facts: dict, default: dict) -> list[str]:
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
        ours = pooled([f["row"] for f in fs])
        cells = []
        for label, others in (("llmc", [facts[f["against"]]["row"] for f in fs]),
                              ("the default", [default[f["seed"]]["row"] for f in fs])):
            d, ci = paired_diff(ours, pooled(others))
            span = f" ({ci[0]:+.2f}..{ci[1]:+.2f})" if ci else ""
            cells.append(f"minus {label} {d:+.2f}%{span}")
        out.append(f"`{' '.join(flags)}` pooled over seeds {', '.join(map(str, seeds))}: "
                   + "; ".join(cells) + ".")
    return out


def main(argv=None) -> str | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_args(ap, "llmc-vs-default", "llmc-compare")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--articles", type=int, default=5)
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
    args = ap.parse_args(argv)
    steps, tools = set(args.steps.split(",")), set(args.tools.split(","))
    import torch
    torch.set_num_threads(args.threads)
    assets = Path(args.assets).resolve()
    out = Path(args.out).resolve() / f"smollm2-{args.articles}"
    out.mkdir(parents=True, exist_ok=True)
    calib = assets / "calib/wiki-paragraphs.txt"
    py = Path(args.llmc_python)
    llmc = cl.llmc_version(py) if "llmc" in tools or "report" in steps else ""
    src = cl.hf_folder(assets / MODELS["smollm2"]["spec"], Path(args.out).resolve() / "smollm2-hf")
    if llmc:
        print(f"running {llmc} from {py}", flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = [parse_variant(v, seeds[0]) for v in args.variant]
    n = args.num_samples
    # rows: (name, tool, seed, flags, against)
    plan = []
    for s in seeds:
        tag = f"n{n}-seed{s}"
        plan.append((f"llmc-{tag}", "llmc", s, None, None))
        plan.append((f"fp8ptq-{tag}", "fp8ptq", s, [], f"llmc-{tag}"))
        plan += [(f"fp8ptq-{k}-{tag}", "fp8ptq", s, f.split(), f"llmc-{tag}")
                 for k, at, f in variants if s in at]
    plan = [p for p in plan if p[1] in tools] if "report" not in steps else plan
    facts = {}
    if "quantize" in steps:
        for name, tool, s, flags, _ in plan:
            dest = out / name
            t0 = time.strftime("%H:%M", time.gmtime())
            if tool == "llmc":
                w = windows_file(src, calib, n, s, out)
                f = quantize_llmc(py, src, w, n, dest, args.threads)
                print(f"{name} (from {t0}): oneshot {f.get('oneshot_seconds', 0):.0f} s, "
                      f"child {f['wall_seconds']:.0f} s, {f['peak_rss_mb']:.0f} MB", flush=True)
            else:
                f = quantize_fp8ptq(src, calib, n, s, dest, flags, args.threads)
                print(f"{name} (from {t0}): calibrate+quantize "
                      f"{f['calibrate_quantize_seconds']:.0f} s, child {f['wall_seconds']:.0f}"
                      f" s, {f['peak_rss_mb']:.0f} MB", flush=True)
    if not steps & {"eval", "report"}:
        return None
    base = Recipe(calib_data=str(calib), dtype="float32")
    eval_data, scores = str(assets / MODELS["smollm2"]["data"]), out
    if args.first_article != 1:
        eval_data, scores = article_slice(Path(eval_data), args.first_article, args.articles, out)
    eval_kwargs = {"data": {TASK: eval_data},
                   "limit": args.articles, "seq_len": 2048, "batch_size": None}
    texts = job.calibration_texts(base, str(src))
    docs = [run_one("baseline", None, str(src), base, texts, TASK, eval_kwargs, scores)]
    for name, tool, s, flags, against in plan:
        dest = out / name
        if not dest.exists():
            print(f"{name}: not quantized yet, skipped", flush=True)
            continue
        doc = run_one(name, {}, str(src), base, texts, TASK, eval_kwargs, scores,
                      checkpoint=str(dest))
        docs.append(doc)
        print(f"{name}: {doc['metrics'][METRIC]:.3f} ({doc['wall_seconds']:.0f} s)", flush=True)
        if tool == "llmc":
            f = json.loads((dest / "llmc_run.json").read_text())
            facts[name] = {"label": "llm-compressor", "cq": f.get("oneshot_seconds", 0.0),
                           "wall": f["wall_seconds"], "rss": f["peak_rss_mb"],
                           "load_after": f["load_after"], "version": f["llmcompressor"],
                           "windows_sha256": f["windows_sha256"]}
        else:
            f = json.loads(dest.with_name(dest.name + ".quantize.json").read_text())
            label = "fp8ptq default" if not flags else f"fp8ptq default `{' '.join(flags)}`"
            calib_meta = json.loads((dest / "fp8ptq.json").read_text())["calibration"]
            facts[name] = {"label": label, "cq": f["calibrate_quantize_seconds"],
                           "wall": f["wall_seconds"], "rss": f["peak_rss_mb"],
                           "load_after": f["load_after"], "flags": flags,
                           "windows_sha256": calib_meta["sha256"]}
        facts[name].update(seed=s, row=doc, against=against if against in facts else None)
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
    text = section(docs, by_name, facts, args, meta)
    summary = {k: {kk: vv for kk, vv in f.items() if kk != "row"} for k, f in facts.items()}
    for k, f in facts.items():
        if f.get("against"):
            d, ci = paired_diff(f["row"], facts[f["against"]]["row"])
            summary[k]["minus_llmc_pct"], summary[k]["minus_llmc_pct_ci95"] = d, ci
    block = "llmc-compare" if args.first_article == 1 else "llmc-compare-selection"
    return write_section(scores, {"llmcompressor": llmc, "rows": summary, "report": report_doc},
                         text, args.doc, block)


if __name__ == "__main__":
    main()
