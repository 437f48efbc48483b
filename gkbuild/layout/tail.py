"""The sampling tail: the lm_head split over the vocabulary, and who owns which rows after the
all-to-all (semantics of nki-library's ``compose_hops`` / ``owned_row_block`` / ``owned_rows``).

Hops: hop i groups ranks that differ only in mixed-radix digit i of the rank (digit 0 least
significant, stride prod(hops[:i])); e.g. (8, 16) is 8 contiguous ranks, then 16 at stride 8. Each
hop splits the rows a rank holds into hops[i] chunks and sends chunk k to the group member with
digit k, so after all hops rank r owns gbs/vtp rows starting at sum_i digit_i * gbs/prod(hops[:i+1]).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .dims import Dims

if TYPE_CHECKING:
    import numpy as np

# The array code is imported where it is used: the plan (and a no-op build) needs only the hops.


def lm_head_t(dims: Dims, v: int, w: np.ndarray) -> np.ndarray:
    """HF lm_head [V, H] (or just its rows of vocab rank v) -> lm_head_weight_t [Hp, V_s], C-contiguous."""
    from . import hidden

    rows = w[v * dims.V_s:(v + 1) * dims.V_s] if w.shape[0] == dims.V else w
    return hidden.to_kernel_t(rows, dims.Hp)


def lm_head_t_inverse(dims: Dims, shards: list[np.ndarray]) -> np.ndarray:
    import numpy as np

    from . import hidden

    return np.concatenate([hidden.from_kernel(np.ascontiguousarray(s.T), 1, dims.H) for s in shards])


def _check(vtp: int, hops) -> tuple[int, ...]:
    hops = tuple(int(h) for h in (hops or (vtp,)))
    if math.prod(hops) != vtp or any(h < 1 for h in hops):
        raise ValueError(f"hops {hops} do not multiply to vtp {vtp}")
    return hops


def digits(rank: int, hops) -> list[int]:
    out, stride = [], 1
    for h in hops:
        out.append((rank // stride) % h)
        stride *= h
    return out


def compose_hops(vtp: int, hops) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """One replica-group mesh per hop; each group lists its ranks in digit order."""
    hops = _check(vtp, hops)
    meshes, stride = [], 1
    for h in hops:
        bases = [r for r in range(vtp) if (r // stride) % h == 0]
        meshes.append(tuple(tuple(b + k * stride for k in range(h)) for b in bases))
        stride *= h
    return tuple(meshes)


def owned_row_block(rank: int, vtp: int, gbs: int, hops=None) -> tuple[int, int]:
    """(row_start, n_rows) of the batch rows ``rank`` owns after the all-to-all."""
    hops = _check(vtp, hops)
    if gbs % vtp:
        raise ValueError(f"batch {gbs} is not a multiple of vtp {vtp}")
    start, span = 0, gbs
    for d, h in zip(digits(rank, hops), hops):
        span //= h
        start += d * span
    return start, gbs // vtp


def owned_rows(rank: int, vtp: int, gbs: int, hops=None, batch_groups: int = 1) -> list[int]:
    """The global rows ``rank`` owns, in receive order; with G batch groups (single hop) the
    exchange runs once per group of gbs/G rows, so the rank owns a strided set."""
    hops = _check(vtp, hops)
    if batch_groups == 1:
        start, n = owned_row_block(rank, vtp, gbs, hops)
        return list(range(start, start + n))
    if len(hops) != 1:
        raise ValueError("batch groups need a single-hop exchange")
    per_rank = gbs // vtp
    if gbs % vtp or per_rank % batch_groups:
        raise ValueError(f"rows per rank {per_rank} must be a multiple of batch_groups {batch_groups}")
    group_rows, n = gbs // batch_groups, per_rank // batch_groups
    return [g * group_rows + rank * n + k for g in range(batch_groups) for k in range(n)]


# -- the tail kernel's eligibility rules for a batch-grouped exchange ------------------------------
# (gpt_oss_tail_chunked_megakernel and its chunked_topk: a top-k instruction reduces fewer than
# 2^16 elements of a 16-partition snake, 8 rows to a 128-partition tile)
_TOPK_N_MAX, _PARTS, _ROWS_PER_TILE, _PMAX = 1 << 16, 16, 8, 128


def _snake(n: int) -> int:
    return _PARTS * -(-n // _PARTS)


def topk_chunks(rows: int, vocab: int, k: int) -> int:
    """The vocab chunk count P the tail's chunked top-k picks: 1 when one top-k call holds the
    vocabulary; else the smallest legal power of two, preferring whole tiles and 16-wide chunks."""
    if _snake(vocab) < _TOPK_N_MAX:
        return 1
    best = None
    p = 1
    while p <= _PMAX:
        w = vocab // p
        legal = (vocab % p == 0 and w >= 8 and _snake(w) < _TOPK_N_MAX and k <= w
                 and (p == 1 or 8 <= p * k <= _PMAX * _PMAX))
        if legal:
            rank = ((rows * p) % _ROWS_PER_TILE != 0, w % _PARTS != 0, p)
            best = min(best or rank, rank)
        p *= 2
    if best is None:
        raise ValueError(f"no legal top-k chunk count for vocab {vocab}, k {k}")
    return best[2]


def receive_fold_supported(rows: int, vocab: int, k: int, peer_width: int) -> bool:
    """Whether the chunked top-k can read the all-to-all's receive layout in place (the kernel
    exports this predicate; G > 1 requires it)."""
    if peer_width <= 0:
        return False
    p = topk_chunks(rows, vocab, k)
    if p == 1:
        return False
    w = vocab // p
    if k % _PARTS or (rows * p) % _ROWS_PER_TILE or w % _PARTS:
        return False
    return vocab % peer_width == 0 and (-(-w // _PARTS)) % peer_width == 0 and w % peer_width == 0


def batch_groups_refusal(gbs: int, vtp: int, hops, groups: int, vocab: int, k: int) -> str | None:
    """Why the tail kernel would refuse ``a2a_batch_groups = groups`` at this geometry (None: it
    would not): single hop, whole 128-row lm_head tiles per group, groups dividing each rank's
    rows, and the receive-layout fold."""
    if groups == 1:
        return None
    if len(tuple(hops or (vtp,))) != 1:
        return "batch groups are defined for a single-hop exchange only"
    if gbs % groups or (gbs // groups) % _PMAX:
        return f"each batch group ({gbs} rows / {groups}) must be whole {_PMAX}-row lm_head tiles"
    rows = gbs // vtp
    if gbs % vtp or rows % groups:
        return f"the groups must divide the {rows} rows each rank owns"
    if not receive_fold_supported(rows, vocab, k, vocab // vtp):
        return (f"the receive-layout fold is not supported for {rows} rows a rank, vocabulary {vocab}, "
                f"k {k} and {vocab // vtp} columns a peer (a vocabulary that one top-k call holds gets no fold)")
    return None
