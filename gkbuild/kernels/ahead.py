"""Experts decoded ahead on other threads while verify's emulated ranks compute.

Replay's ranks are greenlets on one thread: attention, routing and the collectives hold it, and
each rank read its own MX experts in turn when its MoE came (~50 ms an expert at 120b widths, 128
a layer), so one core did everything. Here threads read every rank's experts (``read``: the rank's
``decode.DecodedExpert`` of its own tensors, so a damaged shard is still read, checked and blamed as
its own) ahead of their use, into a few buffers they reuse (bounded memory; fresh blocks of this size
would be new mappings in a thread's arena, faulted in each time). numpy's take and torch's kernels
release the GIL, so they run beside the ranks.

They read a layer's experts in the order the ranks asked for the last whole layer's (the emulator's
schedule repeats layer after layer; ``guess`` until one is seen). ``get`` is ``decode.ExpertCache``'s:
an expert not read ahead (asked out of that order, or a reader failed) is made by the rank itself,
so the readers change when work is done, never what is computed or which errors are raised.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .. import parallel


class ExpertsAhead:
    """Experts keyed (rank, layer, expert), read by ``read(rank, layer, expert, out)`` into ``out``
    (None: the reader makes it ``sizes`` buffers), ``layers`` layers of the ``guess`` (rank, expert)s
    each; ``slots``: experts held at once (read and not yet used, plus the one in use); ``readers``:
    threads reading."""

    def __init__(self, read: Callable, sizes: tuple, guess: list, layers: int, slots: int = 4, readers: int = 1):
        self._read_one, self._sizes, self._order = read, sizes, list(guess)
        self._jobs = self._plan(layers)
        self._free = [None] * slots  # buffers, made on first use
        self._ready: dict = {}  # key -> (layer, expert, buffers)
        self._asked: set = set()
        self._seen: dict = {}  # layer -> the (rank, expert)s asked for, in order
        self._reading: set = set()  # keys being read now
        self._held = None  # the buffers of the expert last handed out
        self._layer = -1  # the layer last asked for: what is left of earlier ones is dropped
        self._stop = False
        self._cv = threading.Condition()
        self._threads = [threading.Thread(target=self._read, name=f"gkbuild-experts-ahead-{n}", daemon=True)
                         for n in range(readers)]
        for th in self._threads:
            th.start()

    def _plan(self, layers: int):
        for i in range(layers):
            for r, e in list(self._order):  # the last whole layer's order when this layer's reading starts
                yield (r, i, e)

    def _next(self):
        """The next key worth reading and a free buffer for it (None: stop)."""
        with self._cv:
            while not self._free and not self._stop:
                self._cv.wait()
            for key in self._jobs:
                if self._stop:
                    return None
                if key not in self._asked and key[1] >= self._layer:
                    self._reading.add(key)
                    return key, self._free.pop()
            return None

    def _read(self) -> None:
        parallel.one_thread()
        while (job := self._next()) is not None:
            key, out = job
            try:
                if out is None:
                    out = tuple(torch.empty(n) for n in self._sizes)
                got = (key[1], self._read_one(*key, out), out)
            except Exception:  # noqa: BLE001 - the rank that asks reads it itself and raises its own error
                got = None
            with self._cv:
                self._reading.discard(key)
                if got is None:
                    self._stop = True
                else:
                    self._ready[key] = got
                self._cv.notify_all()

    def get(self, key, make: Callable):
        """The expert ``key`` (read ahead, or ``make()`` now); the one handed out before is done."""
        with self._cv:
            if self._held is not None:
                self._free.append(self._held)
                self._held = None
            self._asked.add(key)
            seen = self._seen.setdefault(key[1], [])
            seen.append((key[0], key[2]))
            if len(seen) == len(self._order):
                self._order = list(seen)
            while key in self._reading:
                self._cv.wait()
            layer = key[1]
            if layer > self._layer:  # what is left of an earlier layer will not be asked for
                self._layer = layer
                for k in [k for k, (i, *_) in self._ready.items() if i < layer]:
                    self._free.append(self._ready.pop(k)[2])
            got = self._ready.pop(key, None)
            if got is not None:
                self._held = got[2]
            self._cv.notify_all()
        return make() if got is None else got[1]

    def close(self) -> None:
        """Stop the readers and wait for them (before the build's mapped files close)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for th in self._threads:
            th.join()

    def __enter__(self) -> "ExpertsAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
