"""Tables that fit the terminal without rich's "e4m3…" truncation.

rich shrinks the widest columns first when a table is too wide and cuts their cells with "…",
which for names is useless. ``fitted_table`` instead wraps multi-word headers, then leaves out the
least important columns (those with the highest ``drop``), and only if even that is too wide lets
cells fold onto a second line: a cell is never shortened.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


@dataclass
class Column:
    header: str
    cells: list[str]
    justify: str = "right"
    drop: int = 0  # 0: always shown; when too wide, the highest ``drop`` goes first


def fitted_table(console: Console, columns: list[Column],
                 **table_kwargs) -> tuple[Table, list[str]]:
    """The widest table of ``columns`` that fits ``console.width``, and the headers left out."""
    kept = list(columns)
    # Fitting measures a probe: each column with only its widest cell. A table's unconstrained
    # width is the sum of its columns' widest cells (plus padding and rules), so the probe
    # measures the same; measuring every row of a 210-GEMM report up to a dozen times took
    # seconds of a quantize run.
    probes = {id(c): Column(c.header, [_widest(console, c.cells)] if c.cells else [],
                            c.justify, c.drop) for c in columns}
    while True:
        for wrap_headers in (False, True):
            probe = _build([probes[id(c)] for c in kept], wrap_headers, table_kwargs)
            if _width(console, probe) <= console.width:
                return _build(kept, wrap_headers, table_kwargs), \
                    [c.header for c in columns if c not in kept]
        droppable = [c for c in kept if c.drop]
        if not droppable:
            return _build(kept, True, table_kwargs), [c.header for c in columns if c not in kept]
        kept.remove(max(droppable, key=lambda c: c.drop))


def _widest(console: Console, cells: list[str]) -> str:
    """The cell whose widest line is widest as the table renders it (markup applied)."""
    return max(cells, key=lambda cell: max(
        (cell_len(line) for line in console.render_str(cell, highlight=False).plain.split("\n")),
        default=0))


def _build(columns: list[Column], wrap_headers: bool, table_kwargs: dict) -> Table:
    table = Table(box=box.SIMPLE_HEAD, **table_kwargs)
    for c in columns:
        header = c.header.replace(" ", "\n") if wrap_headers else c.header
        table.add_column(header, justify=c.justify, overflow="fold")
    for row in zip(*(c.cells for c in columns)):
        table.add_row(*row)
    return table


def _width(console: Console, table: Table) -> int:
    # measured unconstrained: Measurement.get clamps to the width it is given
    return Measurement.get(console, console.options.update_width(10_000), table).maximum
