"""Independent chunks of array work on the host's cores: numpy's take and ufuncs and torch's
kernels release the GIL inside their loops, so threads overlap where a process has only one
interpreter (verify's emulated ranks are greenlets on one thread). One pool for the process: the
reference and verify hand it tens of thousands of small chunk lists (publish's ``run_each`` makes a
pool a call, for a few long file transfers it can cancel). A call from one of the pool's own threads
runs its items in that thread: a worker waiting on work queued behind it would wait forever."""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

WORKERS = max(1, min(os.cpu_count() or 1, 4))


_here = threading.local()


def _mark() -> None:
    _here.worker = True


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(WORKERS, thread_name_prefix="gkbuild-chunk", initializer=_start)


# A forked child (the build's emission workers) inherits the pool object but none of its threads:
# work queued on it would wait forever. The child makes its own on first use.
os.register_at_fork(after_in_child=_pool.cache_clear)


def _start() -> None:
    _mark()
    one_thread()


def one_thread() -> None:
    """This thread's torch kernels on one thread: the pool is the parallelism. OpenMP and MKL keep a
    thread count a thread, and a new thread takes the process's default (the cores) whatever the
    caller set; a matmul's sums then depended on the threads it got, so verify's numbers varied
    from run to run when other threads were busy (without OMP_NUM_THREADS=1)."""
    import torch

    torch.set_num_threads(1)


def each(fn: Callable, items: Iterable) -> list:
    """fn(item) for every item, on up to WORKERS threads (in this one if it is a worker); results in
    order, the first error raised."""
    items = list(items)
    if WORKERS == 1 or len(items) < 2 or getattr(_here, "worker", False):
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))
