"""rich progress on stderr (stdout stays clean for --json)."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

stderr_console = Console(stderr=True)


@contextmanager
def progress_bars(enabled: bool = True):
    """Yields ``step(description)`` -> context manager, and ``bar(total)`` for counted work."""
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=stderr_console,
                        disable=not enabled, transient=False)
    with progress:
        yield Steps(progress)


class Steps:
    def __init__(self, progress: Progress):
        self.progress = progress

    @contextmanager
    def step(self, description: str):
        task = self.progress.add_task(description, total=1)
        yield
        self.progress.update(task, completed=1)

    def counter(self, description: str):
        """Returns ``start(total) -> tick`` for APIs that learn their total late."""

        def start(total: int):
            task = self.progress.add_task(description, total=total)
            return lambda: self.progress.advance(task)

        return start
