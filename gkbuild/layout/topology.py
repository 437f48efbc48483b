"""Rank coordinates and the replica-group meshes the kernels take (tuples of tuples).

Rank r: dp = r // tp, tp = r % tp; the EP group spans all ranks (rank r holds experts
[r*E_L, (r+1)*E_L)); tail vocab rank = r % vtp.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RankCoord:
    rank: int
    dp: int
    tp: int
    ep: int
    vtp: int

    def to_dict(self) -> dict:
        return asdict(self)


def coords(rank: int, tp: int, vtp: int) -> RankCoord:
    return RankCoord(rank=rank, dp=rank // tp, tp=rank % tp, ep=rank, vtp=rank % vtp)


def tp_mesh(tp: int, dp: int) -> tuple[tuple[int, ...], ...]:
    """One TP group per DP replica: [[0..tp-1], [tp..2tp-1], ...]."""
    return tuple(tuple(d * tp + t for t in range(tp)) for d in range(dp))


def ep_mesh(world: int) -> tuple[tuple[int, ...], ...]:
    """The EP group spans every rank."""
    return (tuple(range(world)),)
