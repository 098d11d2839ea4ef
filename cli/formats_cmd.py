"""``fp8ptq formats``: the format table, or every code of one format; ``fp8ptq schemes``: the
named presets of ``--scheme``."""

from __future__ import annotations

import json
import math

import click
import torch
from rich.console import Console
from rich.table import Table

from fp8ptq.config.schemes import SCHEMES, scheme_flags
from fp8ptq.formats import PRESETS, decode, get_format
from fp8ptq.numbers import json_number

from .help_format import OneScreenCommand, example
from .tables import Column, fitted_table


def _pow2(v: float) -> str:
    """``2^-9`` for an exact power of two (every format's smallest normal/subnormal is one)."""
    m, e = math.frexp(v)
    return f"2^{e - 1}" if m == 0.5 else f"{v:.4g}"



@click.command(cls=OneScreenCommand, epilog=example("fp8ptq formats e4m3 --codes"))
@click.argument("name", required=False)
@click.option("--codes", is_flag=True, help="List all codes of NAME with their values.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
def formats(name, codes, as_json):
    """Show the number formats, or with NAME --codes every code of one format."""
    specs = [get_format(name)] if name else list(PRESETS)
    if codes:
        if not name:
            raise click.UsageError("--codes needs a format NAME")
        _print_codes(specs[0], as_json)
        return
    rows = [s.describe() for s in specs]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    cells = lambda f: [f(d) for d in rows]  # noqa: E731
    # drop: at 80 columns the special-value flags and binades give way (--json has them all)
    columns = [
        Column("name", cells(lambda d: d["name"]), "left"),
        Column("E", cells(lambda d: str(d["exponent_bits"]))),
        Column("M", cells(lambda d: str(d["mantissa_bits"]))),
        Column("bias", cells(lambda d: str(d["bias"]))),
        Column("max finite", cells(lambda d: f"{d['max']:g}")),
        Column("min normal", cells(lambda d: _pow2(d["min_normal"]))),
        Column("min subnormal", cells(lambda d: _pow2(d["min_subnormal"]))),
        Column("inf", cells(lambda d: yes(d["has_inf"])), drop=3),
        Column("NaN", cells(lambda d: yes(d["has_nan"])), drop=4),
        Column("-0", cells(lambda d: yes(d["has_negative_zero"])), drop=5),
        Column("binades", cells(lambda d: str(d["binades"])), drop=2),
        Column("rounding", cells(lambda d: d["rounding"]), "left", drop=1),
        Column("scales", cells(lambda d: f"E8M0/{d['mx_block']} {d['mx_scale_rounding']}"
                               if d["mx_block"] else "-"), drop=6),
    ]
    console = Console()
    table, hidden = fitted_table(console, columns, title="fp8ptq number formats")
    if hidden:
        table.caption = f"not shown at this width: {', '.join(hidden)} (see --json)"
    console.print(table)


def _print_codes(spec, as_json):
    values = decode(torch.arange(spec.num_codes, dtype=torch.uint8), spec, dtype=torch.float64)
    values = [json_number(v) for v in values.tolist()]
    if as_json:
        click.echo(json.dumps(values))
        return
    table = Table(title=f"{spec.name}: {spec.num_codes} codes")
    for col in ("code", "hex", "bits", "value"):
        table.add_column(col, justify="right")
    for code, v in enumerate(values):
        table.add_row(str(code), f"0x{code:02X}", f"{code:0{spec.bits}b}", str(v))
    Console().print(table)


@click.command(cls=OneScreenCommand, epilog=example("fp8ptq schemes --json"))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
def schemes(as_json):
    """Show the named presets of --scheme: the flags each stands for, what the peers call it,
    how vLLM serves it."""
    rows = [{"name": s.name, "flags": scheme_flags(s.name), "description": s.description,
             "peers": s.peers, "vllm": s.vllm, "evidence": s.evidence}
            for s in SCHEMES.values()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="fp8ptq schemes (--scheme NAME; explicit flags override its fields)")
    for col in ("scheme", "flags", "peers", "vLLM"):
        table.add_column(col, justify="left")
    for r in rows:
        table.add_row(r["name"], " ".join(r["flags"]), r["peers"] or "-", r["vllm"] or "-")
    Console().print(table)
