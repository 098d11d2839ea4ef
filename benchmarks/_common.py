"""Shared bits of the benchmark scripts: timing, peak RSS, result output."""

from __future__ import annotations

import json
import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

# The offline assets: ``../shared/assets`` beside the checkout, or ``$FP8PTQ_ASSETS`` (a git
# worktree elsewhere points it at the shared folder).
ASSETS = Path(os.environ.get("FP8PTQ_ASSETS") or
              Path(__file__).resolve().parent.parent.parent / "shared" / "assets")
SMOLLM2 = str(ASSETS / "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
CALIB = str(ASSETS / "calib/wiki-paragraphs.txt")
WIKITEXT = str(ASSETS / "wikitext-2-raw/wiki.test.raw")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@contextmanager
def timed(seconds: dict, key: str):
    t0 = time.perf_counter()
    yield
    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0


def emit(title: str, rows: list[dict], json_path: str | None, extra: dict | None = None) -> None:
    """Print ``rows`` as a rich table; write them (plus ``extra``) as JSON to ``json_path``.
    A field holding a dict (a breakdown) goes to the JSON only."""
    table = Table(title=title)
    columns = list(dict.fromkeys(k for row in rows for k, v in row.items()
                                 if not isinstance(v, dict)))
    for col in columns:
        table.add_column(col, justify="left" if col == columns[0] else "right")
    for row in rows:
        table.add_row(*(_cell(row.get(col)) for col in columns))
    Console().print(table)
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows, **(extra or {})}, indent=2) + "\n")


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def best_seconds(fn, repeat: int) -> float:
    """The fastest of ``repeat`` timed calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
