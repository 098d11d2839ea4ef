"""``fp8ptq eval MODEL --tasks wikitext,squad --compare int8,e4m3``: one table of model variants.

Variants, evaluated one after another (each freed before the next is loaded):

* ``baseline``: MODEL unquantized, in the recipe dtype. When MODEL is an fp8ptq output folder,
  the baseline is its recorded base model (fp8ptq.json ``source``), if that is reachable.
* ``--compare bf16|fp16|fp32``: MODEL unquantized in another dtype (``baseline`` or the
  baseline's own dtype add nothing).
* ``--compare FORMAT``: MODEL freshly loaded and quantized like ``fp8ptq quantize`` would with
  the same recipe flags; one calibration set is tokenized once and shared.
* ``--compare SCHEME``: the same with a named preset (``fp8ptq schemes``) over the recipe flags.
* ``--compare DIR``: an fp8ptq checkpoint folder, named by its folder name; or another tool's
  quantized model folder (config.json, no fp8ptq.json: e.g. llm-compressor's
  compressed-tensors output), loaded by transformers with its quantization applied.

A calibration file that is also an evaluation file is refused (``--allow-calib-overlap``
accepts it, with a note in the report): calibrating on the test text flatters the numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

from fp8ptq.checkpoint.card import update_evaluation
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import DataError, GateFailure, UsageError
from fp8ptq.evals import report
from fp8ptq.evals.compare import (  # noqa: F401
    DTYPE_VARIANTS,
    Variant,
    calibration_files,
    check_calib_overlap,
    checkpoint_meta,
    evaluate_variants,
    how_made,
    plan_variants,
    protocol_lines,
)
from fp8ptq.evals.evaluate import prepare
from fp8ptq.evals.report import check_gates, parse_gate, render_table, to_markdown
from fp8ptq.execution.quantize import calib_facts
from fp8ptq.files.atomic import check_writable, write_file
from fp8ptq.io.loading import check_model_spec
from fp8ptq.runtime.usage import time_line, usage

from .help_format import EXAMPLE_MODEL, OneScreenCommand, example
from .options import build_recipe, loading_from, loading_options, note_source, recipe_options
from .progress import progress_bars

# eval's own --seq-len/--batch-size are about the evaluation; the calibration ones move aside
CALIB_FLAG_NAMES = {"calib_seq_len": "--calib-seq-len", "calib_batch_size": "--calib-batch-size"}
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


@click.command("eval", cls=OneScreenCommand, epilog=example(
    f"fp8ptq eval {EXAMPLE_MODEL} --tasks wikitext --compare int8,e4m3 \\",
    "    --calib-data calib.txt --max-delta wikitext.word_perplexity=2%"),
    common=("tasks", "compare", "data_items", "limit", "json_path", "markdown_path", "gates",
            "device", "calib_data"))
@click.argument("model")
@click.option("--tasks", required=True,
              help="Comma-separated: wikitext, squad, any lm-eval task, or a task YAML in "
                   "--include-path.")
@click.option("--compare", default="",
              help="Comma-separated variants besides the baseline: formats (int8, e4m3, "
                   "...), schemes (fp8-dynamic, ...), dtypes (bf16, fp16, fp32), checkpoint "
                   "folders (fp8ptq's, llm-compressor's); FORMAT+attn[-head] / +kv[-head]: "
                   "with FP8 attention / KV cache.")
@click.option("--data", "data_items", multiple=True, metavar="TASK=PATH",
              help="Local data: wikitext=wiki.test.raw, squad=dev.json (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), help="First N documents/questions per task.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Evaluation batch size [chosen from the free memory].")
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
@click.option("--prefix-token", type=click.Choice(["auto", "bos", "eos", "none"]),
              default="auto",
              show_default=True,
              help="Token that conditions the first token of each document in rolling "
                   "log-likelihood, and that variants quantized here open their "
                   "calibration windows with: auto = the BOS the tokenizer adds, else the "
                   "chat template's first token, else BOS, else EOS (the rule quantize's "
                   "windows follow); none = the document's own first token, not scored.")
@click.option("--window-start", type=click.Choice(["first", "every"]), default="first",
              show_default=True,
              help="Which rolling windows open with the prefix token: first = a document's "
                   "first only (lm-eval's windows: later ones open with a text token); every = "
                   "each window, one token shorter (every request a server gets opens with "
                   "the BOS; models such as gemma are trained only so).")
@click.option("--update-card", is_flag=True,
              help="MODEL is an fp8ptq checkpoint: put the table into its README.md model card.")
@click.option("--allow-calib-overlap", is_flag=True,
              help="Allow calibrating on a file that is also evaluation data.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or auto.")
@loading_options
@recipe_options(flag_names=CALIB_FLAG_NAMES)
def command(model, tasks, compare, data_items, limit, batch_size, seq_len, include_path, json_path,
            markdown_path, plot_path, gates, gate_on, delta_mode, samples_path, prefix_token,
            window_start, update_card, allow_calib_overlap, device, **flags):
    """Evaluate MODEL and its variants on TASKS against the baseline; exit 3 if a gate fails."""
    load_options = loading_from(flags)
    check_model_spec(model)
    note_source(model)
    task_list = _split(tasks)
    data = _parse_data(data_items)
    model_meta = checkpoint_meta(model)
    implied = model_meta is not None and flags["recipe_path"] is None
    if implied:
        flags["recipe_path"] = model  # quantize --compare formats the way MODEL was made
    recipe = build_recipe(flags, model=model, flags_only=implied)
    if update_card and model_meta is None:
        raise UsageError("--update-card needs MODEL to be an fp8ptq checkpoint folder")
    request = prepare(model, task_list, _split(compare), recipe=recipe, data=data, limit=limit,
                      batch_size=batch_size, seq_len=seq_len, include_path=include_path,
                      device=device, load_options=load_options, prefix_token=prefix_token,
                      window_start=window_start, allow_calib_overlap=allow_calib_overlap)
    _check_gate_syntax(gates, task_list, request.has_baseline)
    if plot_path and Path(plot_path).suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {plot_path}: expected a {', '.join(PLOT_SUFFIXES)} file")
    for path in (json_path, markdown_path, plot_path, samples_path):
        if path:
            check_writable(path)  # before hours of evaluation, not after
    with progress_bars() as bars:
        result = request.run(bars)
    rows, protocol, notes, calib = result.rows, result.protocol, result.notes, result.calib
    print_report(rows, protocol, notes, delta_mode,
                 made=[how_made(v) for v in request.variants])
    stages = result.stage_seconds
    shown = {k: v for k, v in stages.items() if k != "calibrate+quantize"}  # its parts shown
    line = time_line(shown, always=("load", "eval"))  # shown even when fast, for scripts
    Console(highlight=False).print(line, markup=False, soft_wrap=True)
    context = {"model": model, "tasks": task_list, "calibration": calib_facts(calib),
               "notes": notes, "eval": {"data": data, "limit": limit, "batch_size": batch_size,
                                        "seq_len": seq_len, "include_path": include_path,
                                        "device": request.options["device"]},
               **usage(stages)}  # seconds per stage over every variant, peak_rss_mb
    write_reports(rows, protocol, recipe, context, json_path=json_path,
                  markdown_path=markdown_path, plot_path=plot_path, samples_path=samples_path,
                  mode=delta_mode)
    if update_card:
        update_evaluation(Path(model), to_markdown(rows, delta_mode),
                          protocol_lines(protocol, rows) + [f"note: {n}" for n in notes])
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
    if gates and not has_baseline:
        raise UsageError("--max-delta needs a baseline; the base model of MODEL is not reachable")
    for gate in gates:
        metric = gate.partition("=")[0].strip()
        parse_gate(gate, [metric] if metric else [])
        task = metric.rpartition(".")[0]
        if task in ("wikitext", "squad") and task not in tasks:
            raise UsageError(f"--max-delta {gate}: task {task!r} is not in --tasks")


# --- output ------------------------------------------------------------------------------------


def print_report(rows: list[dict], protocol: dict, notes: list[str], mode: str = "pct",
                 made: list[str] = ()) -> None:
    """The table, then how each variant was made (``made``), the protocol and the notes."""
    console = Console()
    if not console.is_terminal:  # a log file or CI: no need to squeeze into 80 columns
        console.width = max(console.width, 200)
    console.print(render_table(rows, mode))
    for line in list(made) + protocol_lines(protocol, rows) + [f"note: {n}" for n in notes]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def write_reports(rows, protocol, recipe: Recipe, context: dict, *, json_path=None,
                  markdown_path=None, plot_path=None, samples_path=None,
                  mode: str = "pct") -> None:
    """JSON: ``report.to_json`` plus ``context`` at the top and per variant its kind, source,
    dtype and timings (load, calibrate+quantize, eval per task)."""
    if json_path:
        doc = report.to_json(rows, protocol, recipe.to_dict()) | context
        for entry, row in zip(doc["variants"], rows):
            entry.update({k: row[k] for k in ("kind", "source", "dtype", "timings")})
            entry["gemm_paths"] = row.get("gemm_paths")
        write_file(json_path, lambda p: p.write_text(json.dumps(doc, indent=2) + "\n"))
    if markdown_path:
        write_file(markdown_path, lambda p: p.write_text(report.to_markdown(rows, mode)))
    if samples_path:
        def samples(p):
            with open(p, "w") as f:
                for row in rows:
                    for task, records in (row.get("samples") or {}).items():
                        for rec in records:
                            f.write(json.dumps({"variant": row["name"], "task": task, **rec},
                                               default=str) + "\n")
        write_file(samples_path, samples)
    if plot_path:
        write_file(plot_path, lambda p: report.plot_deltas(rows, p))


def apply_gates(rows: list[dict], gates: list[str], gate_on: str = "point") -> None:
    """One ``gate failed:`` line per miss, then exit 3 (GateFailure). Only quantized variants
    (on the fly or checkpoints) are gated; other dtypes of the baseline are for information."""
    gated = [rows[0]] + [r for r in rows[1:] if r["kind"] in ("quantized", "checkpoint")]
    failures = check_gates(gated, gates, gate_on)
    for failure in failures:
        click.echo(f"gate failed: {failure}", err=True)
    if failures:
        checks = len(gates) * (len(gated) - 1)
        raise GateFailure(f"{len(failures)} of {checks} gate checks failed")
