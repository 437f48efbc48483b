"""The token embedding in the forms the GK decode's fused-embedding prologue takes (CONTRACT.md
section 6), and the host form a runtime embeds from.

Every form cuts the table in kernel lanes ([V, Hp]: the hidden axis padded and shuffled like every
hidden-axis tensor), so an embedded row is already the kernel's x.

- host: the whole table in one host-side file; no rank's device program reads it.
- vocab: rank r of W holds rows [r*R, (r+1)*R), R = ceil(V/W), rows past V zero. A token id maps to
  local row id - r*R on the rank that owns it and to -1 on every other rank. Each rank gathers its
  rows for every token of the batch (zeros where it owns none), and a reduce-scatter over the W
  ranks adds the one non-zero row into each rank's token shard.
- hidden: TP rank t holds lanes [t*Hp/TP, (t+1)*Hp/TP) of every row; ids are global. Each rank
  gathers its lanes of its replica's tokens, and an all-to-all over the TP group gives each rank
  every lane of its own tokens.
"""

from __future__ import annotations

import numpy as np

from . import hidden
from .dims import Dims


def table(dims: Dims, w: np.ndarray) -> np.ndarray:
    """HF embed_tokens [V, H] (or any block of its rows) -> [V, Hp] in kernel lanes."""
    return hidden.to_kernel(w, 1, dims.Hp)


def table_inverse(dims: Dims, e: np.ndarray) -> np.ndarray:
    return hidden.from_kernel(e, 1, dims.H)


def vocab_rows(V: int, world: int) -> int:
    """Rows of the vocab-sharded table a rank holds."""
    return -(-V // world)


def vocab_shard(e: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s rows of the kernel-lane table [V, Hp] -> [R, Hp], padded with zero rows."""
    R = vocab_rows(e.shape[0], world)
    return np.ascontiguousarray(hidden.pad(e[rank * R:(rank + 1) * R], 0, R))


def vocab_shards_inverse(shards: list[np.ndarray], V: int) -> np.ndarray:
    """Every rank's shard, in rank order -> the [V, Hp] table (the padding rows must be zero)."""
    return hidden.unpad(np.concatenate(shards, axis=0), 0, V)


def local_ids(ids: np.ndarray, rank: int, rows: int) -> np.ndarray:
    """Global token ids -> this rank's local rows (int32), -1 where another rank owns the id."""
    ids = np.asarray(ids, dtype=np.int64)
    lo = rank * rows
    return np.where((ids >= lo) & (ids < lo + rows), ids - lo, -1).astype(np.int32)


def local_ids_inverse(local: np.ndarray, rank: int, rows: int) -> np.ndarray:
    """Local rows -> global ids; -1 (not owned) stays -1."""
    local = np.asarray(local, dtype=np.int64)
    return np.where(local >= 0, local + rank * rows, -1)


def hidden_shard(e: np.ndarray, t: int, tp: int) -> np.ndarray:
    """TP rank ``t``'s lanes of the kernel-lane table [V, Hp] -> [V, Hp/TP]."""
    cols = e.shape[1] // tp
    return np.ascontiguousarray(e[:, t * cols:(t + 1) * cols])


def hidden_shards_inverse(shards: list[np.ndarray]) -> np.ndarray:
    """Every TP rank's lanes, in TP order -> the [V, Hp] table."""
    return np.concatenate(shards, axis=1)
