"""``fp8ptq quantize MODEL --format e4m3 --output DIR``."""

from __future__ import annotations

import json
import math

import click
from rich.console import Console
from rich.table import Table

from fp8ptq import __version__, job
from fp8ptq.formats import get_format

from .options import build_recipe, recipe_options
from .progress import progress_bars


@click.command("quantize")
@click.argument("model")
@click.option("--format", "fmt", default=None, help="Format name (fp8ptq formats) [e4m3].")
@click.option("--output", "-o", required=True, type=click.Path(), help="Output folder.")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or auto.")
@click.option("--device-map", default=None, help="accelerate device map (e.g. auto).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the report.")
@recipe_options
def command(model, fmt, output, force, device, device_map, as_json, **flags):
    """Calibrate MODEL (hub id, local folder, .gguf) and write an FP8 checkpoint to OUTPUT."""
    from fp8ptq.checkpoint import save_quantized

    recipe = build_recipe(flags, format=get_format(fmt).name if fmt else None)
    timings = job.JobTimings()
    with progress_bars(enabled=not as_json) as bars:
        with bars.step(f"loading {model}"), timings.timed("load"):
            loaded = job.load(model, recipe, device=device, device_map=device_map)
        calib = None
        if job.needs_calibration(recipe):
            with bars.step("tokenizing calibration data"), timings.timed("calibration data"):
                calib = job.calibration_set(loaded, recipe)
        result = job.quantize_loaded(loaded, recipe, calib, timings=timings,
                                     progress=bars.counter("calibrating"))
        with bars.step(f"writing {output}"), timings.timed("write"):
            sizes = save_quantized(
                result, recipe, output, tokenizer=loaded.tokenizer, force=force,
                source={"model": model, "kind": loaded.kind, "path": loaded.resolved_path},
                calib=calib_facts(calib), tool_version=__version__)
    report = report_dict(result, output, sizes, timings, calib)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_report(report)


def calib_facts(calib) -> dict | None:
    if calib is None:
        return None
    return {"source": calib.source, "sha256": calib.sha256, "num_samples": calib.num_samples,
            "seq_len": calib.seq_len, "seed": calib.seed, "num_tokens": calib.num_tokens}


def _finite(v):
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v


def report_dict(result, output, sizes, timings, calib) -> dict:
    return {
        "output": str(output),
        "modules": [{k: _finite(v) for k, v in vars(m).items()} for m in result.modules],
        "skipped": result.skipped,
        "warnings": result.warnings,
        "calibration": calib_facts(calib),
        "sizes": sizes,
        "seconds": {k: round(v, 3) for k, v in timings.seconds.items()},
        "peak_rss_mb": round(job.peak_rss_mb(), 1),
    }


def print_report(report: dict) -> None:
    console = Console()
    table = Table(title=f"quantized {len(report['modules'])} modules "
                        f"(skipped {len(report['skipped'])})")
    for col in ("module", "W fmt", "W scale", "W amax", "W SQNR dB", "A fmt", "A scale",
                "A amax", "A SQNR dB"):
        table.add_column(col, justify="left" if col == "module" else "right")
    fmt = lambda v, spec="{:.3g}": "-" if v is None else spec.format(v)  # noqa: E731
    for m in report["modules"]:
        w_scale = fmt(m["weight_scale_max"]) if m["weight_scale_min"] == m["weight_scale_max"] \
            else f"{m['weight_scale_min']:.2g}..{m['weight_scale_max']:.2g}"
        table.add_row(m["name"], m["weight_format"], w_scale, fmt(m["weight_amax"]),
                      fmt(m["weight_sqnr_db"], "{:.1f}"), m["act_format"] or "-",
                      fmt(m["input_scale"]), fmt(m["input_amax"]),
                      fmt(m["input_sqnr_db"], "{:.1f}"))
    for name in report["skipped"]:
        table.add_row(f"[dim]{name}[/dim]", "skipped", *["" for _ in range(7)])
    console.print(table)
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}")
    s = report["sizes"]
    if s.get("checkpoint_bytes") and s.get("original_bytes"):
        console.print(f"checkpoint {s['checkpoint_bytes'] / 2**20:.1f} MiB vs original "
                      f"{s['original_bytes'] / 2**20:.1f} MiB "
                      f"({s['checkpoint_bytes'] / s['original_bytes']:.2f}x)")
    secs = ", ".join(f"{k} {v:.1f}s" for k, v in report["seconds"].items())
    console.print(f"time: {secs}; peak RSS {report['peak_rss_mb']:.0f} MiB -> {report['output']}")
