"""``fp8ptq sensitivity MODEL``: which modules (or blocks) to keep in higher precision."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fp8ptq import sensitivity as sens
from fp8ptq.errors import UsageError
from fp8ptq.execution import strategy
from fp8ptq.execution.quantize import calib_facts
from fp8ptq.execution.sensitivity_job import run_sensitivity
from fp8ptq.files.atomic import check_writable, write_text
from fp8ptq.formats import get_format
from fp8ptq.io.loading import check_model_spec
from fp8ptq.numbers import fmt_num
from fp8ptq.runtime.usage import time_line, usage

from .help_format import EXAMPLE_MODEL, OneScreenCommand, example
from .options import build_recipe, loading_from, loading_options, note_source, recipe_options
from .progress import progress_bars, stderr_console


def _format_list(text: str, flag: str) -> list[str]:
    names = [get_format(n).name for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"{flag} needs at least one format name")
    return names


def _output_path(path: str | None, suffix: str | None = None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if not p.parent.is_dir():
        raise UsageError(f"folder of {path} does not exist")
    check_writable(p)
    if suffix and p.suffix.lower() != suffix:
        raise UsageError(f"--plot writes a PNG; give a path ending in {suffix}, got {path}")
    return path


@click.command("sensitivity", cls=OneScreenCommand, epilog=example(
    f"fp8ptq sensitivity {EXAMPLE_MODEL} --format e4m3 --calib-data calib.txt \\",
    "    --eval-data wiki.test.raw --target-delta 1% --json sens.json"),
    common=("fmt", "level", "metric", "eval_data", "target_delta", "json_path",
            "device", "calib_data"))
@click.argument("model")
@click.option("--format", "fmt", default="e4m3", show_default=True,
              help="Format(s) measured with the metric, comma-separated; the first is the "
                   "base format of the suggestion.")
@click.option("--formats", "stat_formats", default=",".join(sens.DEFAULT_STAT_FORMATS),
              show_default=True, help="Formats whose per-module statistics (scales, weight / "
                                      "input / output SQNR) are reported.")
@click.option("--granularity-level", "level", type=click.Choice(sens.LEVELS), default="module",
              show_default=True, help="module: one GEMM at a time; block: all GEMMs of one "
                                      "decoder layer.")
@click.option("--metric", type=click.Choice(sens.METRICS), default="ppl", show_default=True,
              help="ppl: perplexity of a short eval slice (one pass per unit); sqnr: output "
                   "SQNR per GEMM on calibration rows (no pass per unit; for big models).")
@click.option("--eval-data", help="Text for the perplexity slice (.txt/.raw/.json/.jsonl/"
              f".parquet or hub dataset) [{sens.DEFAULT_EVAL_DATA}].")
@click.option("--eval-tokens", type=int, default=2048, show_default=True,
              help="Tokens in the perplexity slice.")
@click.option("--eval-seq-len", type=int, default=512, show_default=True,
              help="Length of each perplexity window.")
@click.option("--eval-batch-size", type=int, default=4, show_default=True)
@click.option("--target-delta", default="1%", show_default=True,
              help="Allowed total delta: VALUE (perplexity points) or VALUE% of the "
                   "baseline (sqnr: noise/signal, 1% = 20 dB).")
@click.option("--top", type=int, default=10, show_default=True, help="Rows in the table.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write every module, format and measurement here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="PNG: SQNR heatmap (module x format) and the sensitivity ranking.")
@click.option("--no-verify", is_flag=True,
              help="Skip the two check runs (every unit quantized; suggestion applied).")
@click.option("--sequential", is_flag=True,
              help="Stream the model block by block (--metric sqnr): one block's weights in "
                   "memory at a time; the check runs need the whole model and are skipped. "
                   "A plain --max-memory SIZE streams when the model does not fit in it.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or auto.")
@loading_options
@recipe_options
def command(model, fmt, stat_formats, level, metric, eval_data, eval_tokens, eval_seq_len,
            eval_batch_size, target_delta, top, json_path, plot_path, no_verify, sequential,
            device, **flags):
    """Quantize one module (or block) of MODEL at a time and rank the modules by the damage."""
    budget = None  # a plain --max-memory SIZE: the process's budget (as on quantize)
    if flags.get("device_map") is None:
        budget = strategy.process_budget(flags.get("max_memory"))
        if budget is not None:
            flags["max_memory"] = None
    load_options = loading_from(flags)
    check_model_spec(model)
    note_source(model)
    formats = _format_list(fmt, "--format")
    stat_formats = _format_list(stat_formats, "--formats")
    recipe = build_recipe(flags, model=model, format=formats[0])
    for name, value in (("--top", top), ("--eval-batch-size", eval_batch_size)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    json_path, plot_path = _output_path(json_path), _output_path(plot_path, ".png")
    eval_spec = eval_data or sens.DEFAULT_EVAL_DATA
    if metric == "ppl" and recipe.calib_data and \
            Path(eval_spec).resolve() == Path(recipe.calib_data).resolve():
        stderr_console.print("[yellow]warning:[/yellow] --eval-data is the calibration file")
    console = Console()
    if not console.is_terminal:  # a file or pipe: keep module names whole on one line
        console = Console(width=160)
    with progress_bars() as bars:
        run = run_sensitivity(
            model, recipe, formats=formats, stat_formats=stat_formats, level=level,
            metric=metric, eval_data=eval_data, eval_tokens=eval_tokens,
            eval_seq_len=eval_seq_len, eval_batch_size=eval_batch_size, target=target_delta,
            verify=not no_verify, sequential=sequential, max_memory=budget, device=device,
            load_options=load_options, progress=bars)
    _finish(run.result, recipe, model, run.calib, json_path, plot_path, console, top)


def _finish(result, recipe, model, calib, json_path, plot_path, console, top) -> None:
    flags_ = sens.quantize_flags(recipe, result.suggestion)
    command_line = shlex.join(["fp8ptq", "quantize", model, *flags_, "--output", "OUT"])
    if json_path:
        data = result.to_dict(model=model, recipe=recipe.to_dict(),
                              calibration=calib_facts(calib), quantize_command=command_line,
                              peak_rss_mb=usage(result.seconds)["peak_rss_mb"])
        text = json.dumps(data, indent=2, allow_nan=False)
        write_text(json_path, text)
    if plot_path:
        sens.plot(result, plot_path)
    print_report(console, result, top, command_line)
    for path in (json_path, plot_path):
        if path:
            console.print(f"wrote {path}")


def _agg(values, how):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return how(values) if values else None



def _delta_text(result, delta: float) -> str:
    if result.metric == "ppl":
        return f"{delta:+.4g} ({100 * delta / result.baseline:+.2f}%)"
    return f"logits NSR {100 * delta:.3g}%"


def print_report(console: Console, result, top: int, command_line: str) -> None:
    primary = result.formats[0]
    mods = {m.name: m for m in result.modules}
    what = "blocks" if result.level == "block" else "modules"
    console.print(f"[bold]sensitivity of {len(result.units)} {what}[/bold] ({result.note})")
    if result.baseline is not None:
        console.print(f"baseline perplexity {result.baseline:.4f}")
    table = Table(title=f"most sensitive {what} (top {min(top, len(result.units))})")
    table.add_column("#", justify="right")
    table.add_column("unit", overflow="fold")
    columns = [f"{f} ppl" if result.metric == "ppl" else f"{f} out dB" for f in result.formats]
    columns = [c for col in columns for c in (col, "delta")]
    for col in (*columns, "W SQNR", "I SQNR", "out SQNR", "I amax", "I crest", "I kurt",
                "W crest"):
        table.add_column(col, justify="right", overflow="fold")
    for rank, unit in enumerate(result.units[:top], 1):
        ms = [mods[n] for n in unit.modules]
        st = [m.formats.get(primary) for m in ms]
        cells = []
        for f in result.formats:
            m = unit.results[f]
            cells += [fmt_num(m.value, "{:.4f}" if result.metric == "ppl" else "{:.1f}"),
                      fmt_num(m.delta, "{:+.4g}") if result.metric == "ppl"
                      else fmt_num(100 * m.delta, "{:.3g}%")]
        cells += [
            fmt_num(_agg([s.weight_sqnr_db for s in st if s], min), "{:.1f}"),
            fmt_num(_agg([s.input_sqnr_db for s in st if s], min), "{:.1f}"),
            fmt_num(_agg([s.output_sqnr_db for s in st if s], min), "{:.1f}"),
            fmt_num(_agg([m.input.amax for m in ms if m.input], max)),
            fmt_num(_agg([m.input.outlier_ratio for m in ms if m.input], max), "{:.1f}"),
            fmt_num(_agg([m.input.kurtosis for m in ms if m.input], max), "{:.1f}"),
            fmt_num(_agg([m.weight.outlier_ratio for m in ms], max), "{:.1f}"),
        ]
        table.add_row(str(rank), unit.name, *cells)
    console.print(table)
    console.print(escape(f"SQNR columns: {primary}, worst module of the unit; crest = amax / "
                         "rms; kurt = E[x^4]/E[x^2]^2"), style="dim")
    s = result.suggestion
    all_q = result.checks.get("all_quantized")
    line = f"every {what[:-1]} in {primary}: estimated {_delta_text(result, s.estimated_delta_all)}"
    if all_q:
        line += f"; measured {_check_text(result, all_q)}"
    console.print(line)
    kept = f"{len(s.skip)} kept in high precision" + (
        f", {len(s.overrides)} moved to another format" if s.overrides else "")
    line = (f"suggestion for --target-delta {s.target} (<= {fmt_num(s.target_delta, '{:.4g}')}): "
            f"{kept}; estimated {_delta_text(result, s.estimated_delta)}")
    if result.checks.get("suggested"):
        line += f"; measured {_check_text(result, result.checks['suggested'])}"
    console.print(line)
    console.print(command_line, soft_wrap=True, markup=False, highlight=False)
    for w in result.warnings[:20]:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}")
    console.print(time_line(result.seconds, min_seconds=0))


def _check_text(result, check: dict) -> str:
    if "perplexity" in check:
        return f"ppl {check['perplexity']:.4f} ({_delta_text(result, check['delta'])})"
    return (f"logits SQNR {fmt_num(check['logits_sqnr_db'], '{:.1f}')} dB (NSR "
            f"{100 * check['nsr']:.3g}%)")
