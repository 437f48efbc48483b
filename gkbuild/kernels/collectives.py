"""The collectives the GK kernels issue, behind one small interface with two implementations.

- ``Single``: world size 1; every collective is the identity.
- ``Emulator``: every rank of a topology runs in one process, each seeing only its own shards.
  Ranks are greenlets on one thread: a rank runs until it enters a collective, then the next rank
  runs. When the last member of the replica group arrives, the collective is computed once for
  the group (gathers concatenate in group order, sums add in group order, so results are
  deterministic) and the members resume with their share. No OS threads, no locks: 128 ranks
  cost little more than their arithmetic.

Groups are named the way the kernels take them: ``"tp"`` (the rank's TP replica group), ``"ep"``
(all ranks), and ``("hop", i)`` for the tail's i-th all-to-all mesh.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

import torch
from greenlet import greenlet

from ..errors import GkError


class Collectives(Protocol):
    rank: int

    def all_gather(self, x: torch.Tensor, group) -> torch.Tensor:
        """Concatenate every member's ``x`` along dim 0, in group order."""

    def reduce_scatter(self, x: torch.Tensor, group) -> torch.Tensor:
        """Sum every member's ``x``, then keep this member's 1/n of dim 0."""

    def all_to_all(self, x: torch.Tensor, group) -> torch.Tensor:
        """Split ``x``'s rows into n chunks, chunk j to member j; concatenate what arrives along
        dim 1 in group order."""

    def reduce_scatter_rows(self, rows: torch.Tensor, values: torch.Tensor, n: int, group) -> torch.Tensor:
        """``reduce_scatter`` of an [n, ...] tensor that is zero except at ``rows`` (``values``):
        the same sums in the same order, without adding the zero rows (verify's live rows)."""


def _scatter_rows(rows: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros((n, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, rows, values)


class Single:
    """World size 1."""

    rank = 0

    def all_gather(self, x, group):
        return x

    def reduce_scatter(self, x, group):
        return x

    def all_to_all(self, x, group):
        return x

    def reduce_scatter_rows(self, rows, values, n, group):
        return _scatter_rows(rows, values, n)


def _all_gather(xs: list) -> list:
    out = torch.cat(xs, dim=0)
    return [out] * len(xs)


def _split(x: torch.Tensor, n: int) -> tuple:
    if x.shape[0] % n:
        raise GkError(f"a collective splits {x.shape[0]} rows over {n} members")
    return x.split(x.shape[0] // n, dim=0)


def _reduce_scatter(xs: list) -> list:
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    return list(_split(total, len(xs)))


def _all_to_all(xs: list) -> list:
    chunks = [_split(x, len(xs)) for x in xs]
    return [torch.cat([c[pos] for c in chunks], dim=1) for pos in range(len(xs))]


def _reduce_scatter_rows(xs: list) -> list:
    """Members' (rows, values, n), summed into one [n, ...] tensor in group order, then split."""
    rows, values, n = xs[0]
    total = _scatter_rows(rows, values, n)
    for rows, values, _ in xs[1:]:
        total.index_add_(0, rows, values)
    return list(_split(total, len(xs)))


OPS = {"all_gather": _all_gather, "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all,
       "reduce_scatter_rows": _reduce_scatter_rows}


class _Meeting:
    """One replica group's collectives, generation by generation."""

    def __init__(self, size: int):
        self.size = size
        self.deposits: dict[int, list] = {}  # generation -> slots
        self.results: dict[int, list] = {}
        self.waiting: dict[int, list[int]] = {}
        self.taken: dict[int, int] = {}


class Emulator:
    """Runs a function on every rank of a topology, ranks interleaved at their collectives."""

    def __init__(self, meshes: dict):
        """``meshes``: {"tp": [[ranks]...], "ep": [[ranks]...], ("hop", i): [[ranks]...]}."""
        self.meshes = {name: [tuple(g) for g in groups] for name, groups in meshes.items()}
        self.world = sorted({r for groups in self.meshes.values() for g in groups for r in g})
        self._member = {(name, r): g for name, groups in self.meshes.items() for g in groups for r in g}

    def run(self, fn: Callable[[int, "EmulatedRank"], object]) -> list:
        """fn(rank, comm) on every rank; results in rank order. Raises the first rank's error."""
        self._meetings = {}
        self._ready = deque()
        self._scheduler = greenlet.getcurrent()
        results: dict[int, object] = {}
        threads = {}
        for r in self.world:
            threads[r] = greenlet(lambda r=r: results.__setitem__(r, fn(r, EmulatedRank(self, r))),
                                  parent=self._scheduler)
            self._ready.append(r)
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            while self._ready:
                threads[self._ready.popleft()].switch()
        finally:
            torch.set_num_threads(old)
        stuck = [r for r in self.world if r not in results]
        if stuck:
            raise GkError(f"emulated collectives deadlocked: ranks {stuck[:8]} never finished")
        return [results[r] for r in self.world]

    def collective(self, op: str, name, rank: int, gen: int, x: torch.Tensor) -> torch.Tensor:
        group = self._member[(name, rank)]
        m = self._meetings.setdefault((name, group), _Meeting(len(group)))
        pos = group.index(rank)
        slots = m.deposits.setdefault(gen, [None] * m.size)
        slots[pos] = x
        if any(s is None for s in slots):
            m.waiting.setdefault(gen, []).append(rank)
            self._scheduler.switch()  # resumed once the group is complete
        else:
            m.results[gen] = OPS[op](slots)
            del m.deposits[gen]
            self._ready.extend(m.waiting.pop(gen, []))
        out = m.results[gen][pos]
        m.taken[gen] = m.taken.get(gen, 0) + 1
        if m.taken[gen] == m.size:
            del m.results[gen], m.taken[gen]
        return out


class EmulatedRank:
    def __init__(self, emulator: Emulator, rank: int):
        self.em = emulator
        self.rank = rank
        self._gen: dict = {}

    def _call(self, op: str, x: torch.Tensor, group) -> torch.Tensor:
        gen = self._gen.get(group, 0)
        self._gen[group] = gen + 1
        return self.em.collective(op, group, self.rank, gen, x)

    def all_gather(self, x, group):
        return self._call("all_gather", x, group)

    def reduce_scatter(self, x, group):
        return self._call("reduce_scatter", x, group)

    def all_to_all(self, x, group):
        return self._call("all_to_all", x, group)

    def reduce_scatter_rows(self, rows, values, n, group):
        return self._call("reduce_scatter_rows", (rows, values, n), group)
