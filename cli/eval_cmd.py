"""``fp8ptq eval MODEL --tasks wikitext,squad --compare int8,e4m3``: one table of model variants.

Variants, evaluated one after another (each freed before the next is loaded):

* ``baseline``: MODEL unquantized, in the recipe dtype. When MODEL is an fp8ptq output folder,
  the baseline is its recorded base model (fp8ptq.json ``source``), if that is reachable.
* ``--compare bf16|fp16|fp32``: MODEL unquantized in another dtype (``baseline`` or the
  baseline's own dtype add nothing).
* ``--compare FORMAT``: MODEL freshly loaded and quantized like ``fp8ptq quantize`` would with
  the same recipe flags; one calibration set is tokenized once and shared.
* ``--compare DIR``: an fp8ptq checkpoint folder, named by its folder name.

A calibration file that is also an evaluation file is refused (``--allow-calib-overlap``
accepts it, with a note in the report): calibrating on the test text flatters the numbers.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console

from fp8ptq import job
from fp8ptq.errors import DataError, GateFailure, UsageError
from fp8ptq.formats import get_format
from fp8ptq.loading import check_model_spec
from fp8ptq.evals.extractive_qa import is_extractive_qa
from fp8ptq.recipe import Recipe

from .options import build_recipe, loading_from, loading_options, recipe_options
from .progress import progress_bars
from .quantize_cmd import calib_facts

# eval's own --seq-len/--batch-size are about the evaluation; the calibration ones move aside
CALIB_FLAG_NAMES = {"calib_seq_len": "--calib-seq-len", "calib_batch_size": "--calib-batch-size"}
DTYPE_VARIANTS = {"baseline": None, "bf16": "bfloat16", "bfloat16": "bfloat16",
                  "fp16": "float16", "float16": "float16", "fp32": "float32", "float32": "float32"}
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


@dataclass
class Variant:
    name: str
    kind: str  # "baseline" | "dtype" | "quantized" | "checkpoint"
    spec: str  # what job.load loads: a model spec or a checkpoint folder
    recipe: Recipe  # dtype to load in; for "quantized" also how to quantize
    meta: dict | None = None  # a checkpoint's fp8ptq.json


@click.command("eval")
@click.argument("model")
@click.option("--tasks", required=True,
              help="Comma-separated: wikitext, squad, any lm-eval task, or a task YAML in "
                   "--include-path.")
@click.option("--compare", default="",
              help="Comma-separated variants besides the baseline: formats to quantize MODEL to "
                   "(int8, e4m3, ...), dtypes (bf16, fp16, fp32) or fp8ptq checkpoint folders.")
@click.option("--data", "data_items", multiple=True, metavar="TASK=PATH",
              help="Local data: wikitext=wiki.test.raw, squad=dev.json (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), help="First N documents/questions per task.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Evaluation batch size.")
@click.option("--seq-len", type=click.IntRange(min=1),
              help="Maximum evaluation context in tokens [the model's].")
@click.option("--include-path", type=click.Path(), help="Folder of extra lm-eval task YAMLs.")
@click.option("--json", "json_path", type=click.Path(), help="Write the report as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(), help="Write the table as markdown.")
@click.option("--plot", "plot_path", type=click.Path(),
              help="Write a bar chart of the deltas (.png, .svg or .pdf).")
@click.option("--max-delta", "gates", multiple=True, metavar="METRIC=VALUE[%]",
              help="CI gate (repeatable): exit 3 when a quantized variant is worse than the "
                   "baseline by more than VALUE (absolute) or VALUE% (relative).")
@click.option("--gate-on", type=click.Choice(["point", "ci-upper"]), default="point",
              show_default=True,
              help="Judge --max-delta by the point estimate or by the worse end of the "
                   "delta's paired bootstrap 95% interval.")
@click.option("--delta", "delta_mode", type=click.Choice(["pct", "abs"]), default="pct",
              show_default=True, help="Deltas in the table and markdown: relative or absolute.")
@click.option("--samples", "samples_path", type=click.Path(),
              help="Write per-sample records (JSON lines: variant, task, doc id, "
                   "log-likelihood or prediction and scores).")
@click.option("--prefix-token", type=click.Choice(["auto", "bos", "eos"]), default="auto",
              show_default=True,
              help="Token that conditions the first token of each document in rolling "
                   "log-likelihood: auto = the BOS the tokenizer adds, else lm-eval's "
                   "convention (BOS if the tokenizer has one, else EOS).")
@click.option("--allow-calib-overlap", is_flag=True,
              help="Allow calibrating on a file that is also evaluation data.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or auto.")
@loading_options
@recipe_options(flag_names=CALIB_FLAG_NAMES)
def command(model, tasks, compare, data_items, limit, batch_size, seq_len, include_path, json_path,
            markdown_path, plot_path, gates, gate_on, delta_mode, samples_path, prefix_token,
            allow_calib_overlap, device, **flags):
    """Evaluate MODEL and its quantized variants on TASKS; one row per variant, deltas to the
    baseline. Exit 3 when a --max-delta gate fails."""
    from fp8ptq.evals import runner

    load_options = loading_from(flags)
    check_model_spec(model)
    task_list = _split(tasks)
    data = _parse_data(data_items)
    model_meta = _checkpoint_meta(model)
    if model_meta is not None and flags["recipe_path"] is None:
        flags["recipe_path"] = model  # quantize --compare formats the way MODEL was made
    recipe = build_recipe(flags)
    device = job.resolve_device(device)
    variants, notes = plan_variants(model, model_meta, _split(compare), recipe)
    has_baseline = variants[0].kind == "baseline"
    _check_gate_syntax(gates, task_list, has_baseline)
    if plot_path and Path(plot_path).suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {plot_path}: expected a {', '.join(PLOT_SUFFIXES)} file")
    notes += check_calib_overlap(calibration_files(variants, recipe), data, allow_calib_overlap)
    # built-in names, data files, include path and lm-eval task names, before any model is loaded
    runner.check_request(task_list, data, include_path, extractive=False)
    calibrated = [v for v in variants if v.kind == "quantized" and job.needs_calibration(v.recipe)]
    texts = job.calibration_texts(recipe, calibrated[0].spec) if calibrated else None

    rows, protocol, calib = evaluate_variants(
        variants, recipe, texts, task_list, notes, data=data, limit=limit, batch_size=batch_size,
        seq_len=seq_len, include_path=include_path, device=device, load_options=load_options,
        prefix_token=prefix_token)
    from fp8ptq.evals.report import attach_intervals

    attach_intervals(rows)
    print_report(rows, protocol, notes, delta_mode)
    context = {"model": model, "tasks": task_list, "calibration": calib_facts(calib),
               "notes": notes, "eval": {"data": data, "limit": limit, "batch_size": batch_size,
                                        "seq_len": seq_len, "include_path": include_path,
                                        "device": device}}
    write_reports(rows, protocol, recipe, context, json_path=json_path,
                  markdown_path=markdown_path, plot_path=plot_path, samples_path=samples_path,
                  mode=delta_mode)
    if gates:
        apply_gates(rows, list(gates), gate_on)


# --- parsing -----------------------------------------------------------------------------------


def _split(text: str) -> list[str]:
    return list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))


def _parse_data(items) -> dict[str, str]:
    data = {}
    for item in items:
        task, sep, path = item.partition("=")
        if not sep or not task.strip() or not path.strip():
            raise UsageError(f"--data expects TASK=PATH, got {item!r}")
        if not Path(path).expanduser().is_file():
            raise DataError(f"{task.strip()} data file not found: {path}")
        data[task.strip()] = path.strip()
    return data


def _check_gate_syntax(gates, tasks: list[str], has_baseline: bool) -> None:
    """What can be checked before evaluating: syntax, a known direction, a requested task."""
    from fp8ptq.evals.report import parse_gate

    if gates and not has_baseline:
        raise UsageError("--max-delta needs a baseline; the base model of MODEL is not reachable")
    for gate in gates:
        metric = gate.partition("=")[0].strip()
        parse_gate(gate, [metric] if metric else [])
        task = metric.rpartition(".")[0]
        if task in ("wikitext", "squad") and task not in tasks:
            raise UsageError(f"--max-delta {gate}: task {task!r} is not in --tasks")


# --- variants ----------------------------------------------------------------------------------


def _checkpoint_meta(spec: str) -> dict | None:
    from fp8ptq.checkpoint.reader import read_metadata

    path = Path(spec).expanduser()
    return read_metadata(path) if (path / "fp8ptq.json").is_file() else None


def base_model_of(meta: dict) -> str | None:
    """The model an fp8ptq checkpoint was quantized from, if it can still be loaded: the path the
    user gave or its resolved copy if either exists, else a hub id that is cached or reachable."""
    from fp8ptq.loading import hub_offline

    source = meta.get("source") or {}
    for spec in (source.get("model"), source.get("path")):
        if spec and Path(spec).expanduser().exists():
            return spec
    hub_id = source.get("model") if source.get("kind") == "hub" else None
    if hub_id and (_in_hf_cache(hub_id) or not hub_offline()):
        return hub_id
    return None


def _in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def plan_variants(model: str, model_meta: dict | None, compare: list[str],
                  recipe: Recipe) -> tuple[list[Variant], list[str]]:
    """The variants to evaluate, baseline first (if there is one), and notes for the report."""
    notes: list[str] = []
    variants: list[Variant] = []
    base = model
    if model_meta is not None:
        base = base_model_of(model_meta)
        if base is None:
            source = model_meta.get("source") or {}
            notes.append(f"no baseline: the base model of {model} "
                         f"({source.get('model') or source.get('path') or 'not recorded'}) is "
                         f"not reachable; deltas are relative to {_folder_name(model)}")
        else:
            variants.append(Variant("baseline", "baseline", base, recipe))
        variants.append(Variant(_folder_name(model), "checkpoint", model, recipe, model_meta))
    else:
        variants.append(Variant("baseline", "baseline", model, recipe))

    def need_base(item):
        if base is None:
            raise UsageError(f"--compare {item}: needs the base model of {model}, which is not "
                             f"reachable")
        return base

    for item in compare:
        if item.lower() in DTYPE_VARIANTS:
            dtype = DTYPE_VARIANTS[item.lower()] or recipe.dtype
            if dtype != recipe.dtype:
                variants.append(Variant(item.lower(), "dtype", need_base(item),
                                        recipe.merged(dtype=dtype)))
            elif base is None:
                need_base(item)
        elif Path(item).expanduser().is_dir():
            from fp8ptq.checkpoint.reader import read_metadata

            variants.append(Variant(_folder_name(item), "checkpoint", item, recipe,
                                    read_metadata(item)))
        else:
            fmt = _format_name(item)
            variants.append(Variant(fmt, "quantized", need_base(item), recipe.merged(format=fmt)))
    return _unique_names(variants), notes


def _format_name(item: str) -> str:
    try:
        return get_format(item).name
    except UsageError as e:
        raise UsageError(f"--compare {item!r} is neither a format, a dtype (bf16, fp16, fp32, "
                         f"baseline) nor an fp8ptq checkpoint folder ({e})") from None


def _folder_name(path: str) -> str:
    return Path(path).expanduser().resolve().name


def _unique_names(variants: list[Variant]) -> list[Variant]:
    seen, out = set(), []
    for v in variants:
        key = (v.kind, v.spec, v.recipe.format if v.kind == "quantized" else None, v.recipe.dtype)
        if key in seen:  # the same variant twice (e4m3 and fp8, a folder given twice)
            continue
        seen.add(key)
        names = {u.name for u in out}
        name, k = v.name, 2
        while name in names:
            name, k = f"{v.name}#{k}", k + 1
        v.name = name
        out.append(v)
    return out


# --- calibration vs evaluation data ------------------------------------------------------------


def calibration_files(variants: list[Variant], recipe: Recipe) -> list[tuple[str, str]]:
    """(who, path) of the calibration text behind each variant that has one."""
    out = []
    if recipe.calib_data and any(v.kind == "quantized" and job.needs_calibration(v.recipe)
                                 for v in variants):
        out.append(("calibration data", recipe.calib_data))
    for v in variants:
        source = ((v.meta or {}).get("calibration") or {}).get("source")
        if v.kind == "checkpoint" and source:
            out.append((f"the calibration data of {v.name}", source))
    return out


def check_calib_overlap(calib_files, data: dict[str, str], allow: bool) -> list[str]:
    notes = []
    for who, calib_path in calib_files:
        calib = Path(calib_path).expanduser()
        for task, path in data.items():
            if calib.is_file() and os.path.samefile(calib, path):
                what = f"{who} {calib_path} is also the {task} evaluation data"
                if not allow:
                    raise UsageError(f"{what}; calibrate on other text (e.g. wiki.train.raw) "
                                     f"or pass --allow-calib-overlap")
                notes.append(f"{what} (--allow-calib-overlap): its numbers are optimistic")
    return notes


# --- evaluation --------------------------------------------------------------------------------


def evaluate_variants(variants: list[Variant], recipe: Recipe, calib_texts, tasks: list[str],
                      notes: list[str], *, device: str, load_options=None,
                      prefix_token: str = "auto", **eval_kwargs):
    """Load (and quantize) each variant, run the tasks, free it. Returns the report rows, the
    protocol (the first variant's) and the calibration set shared by the quantized variants
    (cut once from ``calib_texts``, what ``job.calibration_texts`` read), or None."""
    from fp8ptq.evals.runner import run_tasks

    rows, protocol, calib, tokenizer = [], None, None, None
    with progress_bars() as bars:
        for v in variants:
            timings = job.JobTimings()
            with bars.step(f"{v.name}: loading {v.spec}"), timings.timed("load"):
                loaded = job.load(v.spec, v.recipe, device=device, **(load_options or {}))
            if v.kind == "quantized":
                use_calib = job.needs_calibration(v.recipe)
                if use_calib and calib is None:
                    with bars.step("tokenizing calibration data"), \
                            timings.timed("calibration data"):
                        calib = job.calibration_set(loaded, recipe, calib_texts)
                job.quantize_loaded(loaded, v.recipe, calib if use_calib else None,
                                    timings=timings,
                                    progress=bars.counter(f"{v.name}: calibrating"))
            tokenizer = loaded.tokenizer or tokenizer
            if tokenizer is None:
                raise UsageError(f"{v.spec} has no tokenizer files and no other variant gave one")
            with bars.step(f"{v.name}: evaluating {', '.join(tasks)}"):
                result = run_tasks(loaded.model, tokenizer, tasks, device=device,
                                   prefix_token=prefix_token, **eval_kwargs)
            if not rows and "wikitext" in tasks:
                notes += prefix_notes(loaded.model, tokenizer, prefix_token, eval_kwargs)
            del loaded
            _free_memory(device)
            if protocol is None:
                protocol = result.protocol
            elif result.protocol != protocol:
                notes.append(f"{v.name} was measured differently from {rows[0]['name']}: "
                             f"{_protocol_diff(protocol, result.protocol)}")
            rows.append(_row(v, result, timings))
    return rows, protocol, calib


def prefix_notes(model, tokenizer, prefix_token, eval_kwargs) -> list[str]:
    """A note when the rolling log-likelihood's prefix token changes the baseline's perplexity
    on the first document by more than 10% against no prefix at all."""
    from fp8ptq.evals import wikitext
    from fp8ptq.evals.harness import make_lm

    if is_extractive_qa(model):
        return []
    data = (eval_kwargs.get("data") or {}).get("wikitext")
    if data is None:
        return []
    lm = make_lm(model, tokenizer, batch_size=1, seq_len=eval_kwargs.get("seq_len"),
                 prefix_token=prefix_token)
    ratio = wikitext.prefix_effect(lm, wikitext.read_articles(data)[0]["page"])
    if abs(ratio - 1) <= 0.10:
        return []
    return [f"the prefix token changes the baseline's perplexity on the first document by "
            f"{100 * (ratio - 1):+.0f}% against no prefix: a context the model does not expect "
            "inflates perplexity and the size of every delta (try --prefix-token bos/eos)"]


def _row(v: Variant, result, timings: job.JobTimings) -> dict:
    meta_recipe = (v.meta or {}).get("recipe")
    return {
        "name": v.name,
        "kind": v.kind,
        "source": v.spec,
        "dtype": (v.meta or {}).get("dtype") or v.recipe.dtype,
        "metrics": result.metrics,
        "records": result.records,  # per-sample columns: paired confidence intervals
        "samples": result.samples,  # per-sample records for --samples
        "seconds": round(sum(result.seconds.values()), 3),  # evaluation only, comparable
        "recipe": v.recipe.to_dict() if v.kind == "quantized" else meta_recipe,
        "timings": {**{k: round(s, 3) for k, s in timings.seconds.items()},
                    "eval": {task: round(s, 3) for task, s in result.seconds.items()}},
    }


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _protocol_diff(a: dict, b: dict) -> str:
    diffs = [f"{task}.{key} {a.get(task, {}).get(key)!r} vs {b.get(task, {}).get(key)!r}"
             for task in dict.fromkeys([*a, *b])
             for key in dict.fromkeys([*a.get(task, {}), *b.get(task, {})])
             if a.get(task, {}).get(key) != b.get(task, {}).get(key)]
    return ", ".join(diffs)


# --- output ------------------------------------------------------------------------------------


def print_report(rows: list[dict], protocol: dict, notes: list[str], mode: str = "pct") -> None:
    from fp8ptq.evals.report import render_table

    console = Console()
    if not console.is_terminal:  # a log file or CI: no need to squeeze into 80 columns
        console.width = max(console.width, 200)
    console.print(render_table(rows, mode))
    for line in protocol_lines(protocol) + [f"note: {n}" for n in notes]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def write_reports(rows, protocol, recipe: Recipe, context: dict, *, json_path=None,
                  markdown_path=None, plot_path=None, samples_path=None,
                  mode: str = "pct") -> None:
    """JSON: ``report.to_json`` plus ``context`` at the top and per variant its kind, source,
    dtype and timings (load, calibrate+quantize, eval per task)."""
    from fp8ptq.evals import report

    if json_path:
        doc = report.to_json(rows, protocol, recipe.to_dict()) | context
        for entry, row in zip(doc["variants"], rows):
            entry.update({k: row[k] for k in ("kind", "source", "dtype", "timings")})
        _write_atomically(json_path, lambda p: p.write_text(json.dumps(doc, indent=2) + "\n"))
    if markdown_path:
        _write_atomically(markdown_path, lambda p: p.write_text(report.to_markdown(rows, mode)))
    if samples_path:
        def samples(p):
            with open(p, "w") as f:
                for row in rows:
                    for task, records in (row.get("samples") or {}).items():
                        for rec in records:
                            f.write(json.dumps({"variant": row["name"], "task": task, **rec},
                                               default=str) + "\n")
        _write_atomically(samples_path, samples)
    if plot_path:
        _write_atomically(plot_path, lambda p: report.plot_deltas(rows, p))


def apply_gates(rows: list[dict], gates: list[str], gate_on: str = "point") -> None:
    """One ``gate failed:`` line per miss, then exit 3 (GateFailure). Only quantized variants
    (on the fly or checkpoints) are gated; other dtypes of the baseline are for information."""
    from fp8ptq.evals.report import check_gates

    gated = [rows[0]] + [r for r in rows[1:] if r["kind"] in ("quantized", "checkpoint")]
    failures = check_gates(gated, gates, gate_on)
    for failure in failures:
        click.echo(f"gate failed: {failure}", err=True)
    if failures:
        checks = len(gates) * (len(gated) - 1)
        raise GateFailure(f"{len(failures)} of {checks} gate checks failed")


def protocol_lines(protocol: dict) -> list[str]:
    def show(value):
        return value if isinstance(value, (int, float, bool)) or value is None or \
            (isinstance(value, str) and "\n" not in value) else json.dumps(value)

    return [f"protocol {task}: " + ", ".join(f"{k}={show(v)}" for k, v in facts.items())
            for task, facts in protocol.items()]


def _write_atomically(path, write) -> None:
    """``write(tmp)`` a sibling temp file (same suffix), then rename it over ``path``."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
