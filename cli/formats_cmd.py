"""``fp8ptq formats``: the format table, or every code of one format."""

from __future__ import annotations

import json
import math

import click
from rich.console import Console
from rich.table import Table

from fp8ptq.formats import PRESETS, decode, get_format

import torch


def _json_number(v: float):
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return int(v) if v == int(v) and abs(v) < 2**53 and not (v == 0 and math.copysign(1, v) < 0) \
        else v


@click.command()
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
    table = Table(title="fp8ptq number formats")
    for col in ("name", "E", "M", "bias", "max finite", "min normal", "min subnormal", "inf",
                "NaN", "-0", "binades", "rounding"):
        table.add_column(col, justify="right" if col not in ("name", "rounding") else "left")
    for d in rows:
        yes = lambda b: "yes" if b else "no"  # noqa: E731
        table.add_row(d["name"], str(d["exponent_bits"]), str(d["mantissa_bits"]), str(d["bias"]),
                      f"{d['max']:g}", f"{d['min_normal']:.4g}", f"{d['min_subnormal']:.4g}",
                      yes(d["has_inf"]), yes(d["has_nan"]), yes(d["has_negative_zero"]),
                      str(d["binades"]), d["rounding"])
    Console().print(table)


def _print_codes(spec, as_json):
    values = decode(torch.arange(spec.num_codes, dtype=torch.uint8), spec, dtype=torch.float64)
    values = [_json_number(v) for v in values.tolist()]
    if as_json:
        click.echo(json.dumps(values))
        return
    table = Table(title=f"{spec.name}: {spec.num_codes} codes")
    for col in ("code", "hex", "bits", "value"):
        table.add_column(col, justify="right")
    for code, v in enumerate(values):
        table.add_row(str(code), f"0x{code:02X}", f"{code:0{spec.bits}b}", str(v))
    Console().print(table)
