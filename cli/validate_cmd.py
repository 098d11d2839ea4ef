"""``fp8ptq validate CKPT [--runtime vllm|transformers|all] [--json]``: exit 0 valid, 4 not."""

from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.markup import escape

from fp8ptq.checkpoint import validate as v
from fp8ptq.runtime.usage import time_line, timed, usage

from .help_format import OneScreenCommand, example

INVALID = 4


@click.command("validate", cls=OneScreenCommand,
               epilog=example("fp8ptq validate out/smollm2-e4m3 --runtime vllm"))
@click.argument("checkpoint", type=click.Path())
@click.option("--runtime", type=click.Choice(["vllm", "transformers", "all"]), default="all",
              show_default=True, help="Which runtime's rules to check.")
@click.option("--no-reload", is_flag=True,
              help="Static rules only (skip loading through transformers and fp8ptq.load).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(checkpoint, runtime, no_reload, as_json):
    """Check CHECKPOINT against what vLLM / transformers accept, and reload it through both."""
    runtimes = v.RUNTIMES if runtime == "all" else (runtime,)
    seconds: dict[str, float] = {}
    with timed(seconds, "validate"):
        report = v.validate(checkpoint, runtimes, reload=not no_reload)
    if as_json:
        click.echo(v.dumps(report, **usage(seconds)))
    else:
        console = Console(highlight=False)
        for violation in report.violations:
            tag = "[red]invalid[/red]" if violation.severity == "error" else "[dim]note[/dim]"
            console.print(f"{tag} {escape(violation.line())}", soft_wrap=True)
        if report.reload is not None:
            r = report.reload
            if "error" in r:
                console.print("[red]invalid[/red] transformers could not load it: "
                              f"{escape(r['error'])}")
            else:
                console.print(f"reload: max |logit difference| transformers vs fp8ptq.load "
                              f"{r['max_abs_logit_diff']:.3g} ({100 * r['relative']:.2f}% of the "
                              f"logit range; tolerance {100 * r['tolerance']:.0f}%)")
                if "kv_cache_off" in r and not r["transformers_quantizes_kv_cache"]:
                    console.print(f"[dim]note[/dim] transformers does not quantize the KV cache "
                                  "here: against fp8ptq.load with K / V unquantized "
                                  f"{100 * r['kv_cache_off']['relative']:.2f}%")
        verdict = "valid" if report.valid else "INVALID"
        console.print(f"{verdict} for {', '.join(runtimes)}: {checkpoint}")
        console.print(time_line(seconds, min_seconds=0))
    if not report.valid:
        sys.exit(INVALID)
