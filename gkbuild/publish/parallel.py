"""Files published or fetched side by side on a thread pool (zstd, sha256 and file I/O release
the GIL)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def run_each(fn: Callable[[T], None], items: Iterable[T], workers: int,
             on_failure: Callable[[], None] = lambda: None) -> None:
    """``fn`` over ``items``; the first failure cancels what has not started, runs ``on_failure``
    once the running ones are done, and is raised."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            for fut in [pool.submit(fn, x) for x in items]:
                fut.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            on_failure()
            raise
