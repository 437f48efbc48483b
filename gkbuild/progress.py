"""Progress bars for long work: bytes/s and ETA on stderr, silent when quiet or not a terminal."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)

console = Console(stderr=True)
Advance = Callable[[int], None]


@contextlib.contextmanager
def bar(description: str, total: int, quiet: bool = False) -> Iterator[Advance]:
    """Yield ``advance(nbytes)``; draws a bar unless quiet or stderr is not a terminal."""
    if quiet or not console.is_terminal:
        yield lambda n: None
        return
    cols = [TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*cols, console=console, transient=False) as p:
        task = p.add_task(description, total=total)
        yield lambda n: p.advance(task, n)


def note(message: str, quiet: bool = False) -> None:
    if not quiet:
        console.print(message, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """Warnings are never silenced by --quiet."""
    console.print(f"[bold yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


def is_tty() -> bool:
    return sys.stderr.isatty()
