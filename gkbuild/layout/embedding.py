"""The token embedding in the forms the GK decode's fused-embedding prologue takes (CONTRACT.md
section 6), and the host form a runtime embeds from.

Every form cuts the table in kernel lanes ([V, Hp]: the hidden axis padded and shuffled like every
hidden-axis tensor), so an embedded row is already the kernel's x.

- host: the whole table in one host-side file; no rank's device program reads it.
- vocab: TP rank t holds rows [t*R, (t+1)*R), R = ceil(V/TP), rows past V zero (every DP replica
  holds the same split). A token id maps to local row id - t*R on the TP rank that owns it and to
  -1 on the others. Each rank gathers its rows for its DP replica's B_attn tokens (zeros where it
  owns none), and a reduce-scatter over the TP group adds the one non-zero row into each rank's
  token shard (the fork F's prologue: gpt_oss_decode_mega_kernel reshapes embed_ids to
  (T_shard*TP, 1) and sums over tp_replica_group).
- hidden: TP rank t holds lanes [t*Hp/TP, (t+1)*Hp/TP) of every row; ids are global. Each rank
  gathers its lanes of its replica's tokens, an all-gather over the TP group concatenates the
  lanes, and ``embed_x_shard_ids`` (t*T_shard + arange) picks the rank's own token rows.
"""

from __future__ import annotations

import numpy as np

from . import hidden
from .dims import Dims
from .scalars import vocab_rows


def table(dims: Dims, w: np.ndarray) -> np.ndarray:
    """HF embed_tokens [V, H] (or any block of its rows) -> [V, Hp] in kernel lanes."""
    return hidden.to_kernel(w, 1, dims.Hp)


def table_inverse(dims: Dims, e: np.ndarray) -> np.ndarray:
    return hidden.from_kernel(e, 1, dims.H)


def vocab_shard(e: np.ndarray, t: int, tp: int) -> np.ndarray:
    """TP rank ``t``'s rows of the kernel-lane table [V, Hp] -> [R, Hp], padded with zero rows."""
    R = vocab_rows(e.shape[0], tp)
    return np.ascontiguousarray(hidden.pad(e[t * R:(t + 1) * R], 0, R))


def vocab_shards_inverse(shards: list[np.ndarray], V: int) -> np.ndarray:
    """Every TP rank's shard, in TP order -> the [V, Hp] table (the padding rows must be zero)."""
    return hidden.unpad(np.concatenate(shards, axis=0), 0, V)


def local_ids(ids: np.ndarray, t: int, rows: int) -> np.ndarray:
    """Global token ids -> TP rank ``t``'s local rows (int32), -1 where another TP rank owns the id."""
    ids = np.asarray(ids, dtype=np.int64)
    lo = t * rows
    return np.where((ids >= lo) & (ids < lo + rows), ids - lo, -1).astype(np.int32)


def local_ids_inverse(local: np.ndarray, t: int, rows: int) -> np.ndarray:
    """Local rows -> global ids; -1 (not owned) stays -1."""
    local = np.asarray(local, dtype=np.int64)
    return np.where(local >= 0, local + t * rows, -1)


def x_shard_ids(t: int, t_shard: int) -> np.ndarray:
    """The hidden placement's ``embed_x_shard_ids``: TP rank ``t``'s token rows of its replica."""
    return (t * t_shard + np.arange(t_shard)).astype(np.int32)


def hidden_shard(e: np.ndarray, t: int, tp: int) -> np.ndarray:
    """TP rank ``t``'s lanes of the kernel-lane table [V, Hp] -> [V, Hp/TP]."""
    cols = e.shape[1] // tp
    return np.ascontiguousarray(e[:, t * cols:(t + 1) * cols])


def hidden_shards_inverse(shards: list[np.ndarray]) -> np.ndarray:
    """Every TP rank's lanes, in TP order -> the [V, Hp] table."""
    return np.concatenate(shards, axis=1)
