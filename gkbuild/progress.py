"""Progress bars for long work: bytes/s and ETA on stderr, silent when quiet or not a terminal."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.text import Text
from rich.progress import (BarColumn, DownloadColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.progress import Progress as _Rich

from .errors import printable

console = Console(stderr=True)
Advance = Callable[[int], None]


class Progress:
    """Named byte-count tasks, one bar each; a no-op when quiet or stderr is not a terminal."""

    def __init__(self, quiet: bool = False):
        self.enabled = not quiet and console.is_terminal
        self._rich = _Rich(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                           DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                           console=console) if self.enabled else None
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> "Progress":
        if self._rich:
            self._rich.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich:
            self._rich.stop()

    def task(self, name: str, description: str, total: int) -> None:
        if self._rich and name not in self._tasks:
            self._tasks[name] = self._rich.add_task(description, total=total or None)

    def advance(self, name: str, n: int) -> None:
        if self._rich and name in self._tasks:
            self._rich.advance(self._tasks[name], n)

    def advancer(self, name: str) -> Advance:
        return lambda n: self.advance(name, n)


@contextlib.contextmanager
def bar(description: str, total: int, quiet: bool = False) -> Iterator[Advance]:
    """One bar; yields ``advance(nbytes)``."""
    with Progress(quiet) as p:
        p.task("main", description, total)
        yield p.advancer("main")


@contextlib.contextmanager
def steps_bar(description: str, total: int, quiet: bool = False) -> Iterator[Callable[[int, str], None]]:
    """One bar counting units of work (layers, steps); yields ``advance(n, where)``, ``where``
    naming the unit in progress (e.g. "step 3/20, layer 7/36")."""
    if quiet or not console.is_terminal:
        yield lambda n, where="": None
        return
    with _Rich(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
               TextColumn("{task.fields[where]}"), TimeRemainingColumn(), console=console) as rich:
        task = rich.add_task(description, total=total or None, where="")
        yield lambda n, where="": rich.update(task, advance=n, where=where)


def note(message: str, quiet: bool = False) -> None:
    """A line for people; what a file or a peer put in it is shown, never obeyed (no markup,
    control characters escaped)."""
    if not quiet:
        console.print(printable(message), markup=False, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """Warnings are never silenced by --quiet."""
    console.print(Text.assemble(("warning:", "bold yellow"), " ", printable(message)), highlight=False, soft_wrap=True)
