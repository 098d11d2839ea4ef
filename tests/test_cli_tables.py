"""``cli.tables.fitted_table`` measures a probe (each column's widest cell) instead of the whole
table: the same width, so the same columns kept and the same table as measuring every row."""

from __future__ import annotations

import io
import random

import pytest
from rich.console import Console

from fp8ptq.cli import tables
from fp8ptq.cli.tables import Column, fitted_table

pytestmark = pytest.mark.slow  # every test here runs over ~5 s (see pyproject.toml)


def _brute_force(console, columns, **kw):
    """The fitting as it was: every candidate table measured row by row."""
    kept = list(columns)
    while True:
        for wrap in (False, True):
            table = tables._build(kept, wrap, kw)
            if tables._width(console, table) <= console.width:
                return [c.header for c in kept], wrap
        droppable = [c for c in kept if c.drop]
        if not droppable:
            return [c.header for c in kept], True
        kept.remove(max(droppable, key=lambda c: c.drop))


def _columns(rng: random.Random, rows: int) -> list[Column]:
    words = ["model.layers.12.self_attn.q_proj", "e4m3", "-", "3.2e-05", "nan", "[red]NaN[/red]",
             "12.5", "two\nlines here", "ü-wide", "日本語", "x" * 40]
    return [Column(f"head {k}" if k % 2 else f"h{k}", [rng.choice(words) for _ in range(rows)],
                   drop=rng.choice([0, 0, 1, 2, 3])) for k in range(rng.randint(1, 9))]


def test_probe_measures_the_same_as_the_whole_table():
    rng = random.Random(0)
    for trial in range(60):
        columns = _columns(rng, rng.randint(0, 30))
        console = Console(width=rng.choice([40, 60, 80, 120, 200]), file=io.StringIO())
        table, hidden = fitted_table(console, columns, title="t")
        kept, wrap = _brute_force(console, columns, title="t")
        assert [c.header.replace("\n", " ") for c in table.columns] == kept, trial
        assert hidden == [c.header for c in columns if c.header not in kept], trial
        assert any("\n" in c.header for c in table.columns) == (
            wrap and any(" " in h for h in kept)), trial
        assert table.row_count == len(columns[0].cells), trial
