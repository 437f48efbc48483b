"""The sampling tail for one vocab rank, in plain PyTorch (CONTRACT.md section 4).

    h      = rmsnorm(hidden [gbs, Hp]) * gamma          fp32, over the real hidden size
    logits = bf16(h) @ lm_head_weight_t [Hp, V_s]        bf16 operands, fp32 accumulation
    rows   = all-to-all of bf16(logits), hop by hop     -> this rank's rows, the full vocabulary
             (or one exchange per batch group)
    top-k  (k candidates, stable: ties keep the lower token id), then the sampler

Sampler (per owned row, params [top_k, top_p, temperature, (u)]): greedy below temperature 1e-5;
otherwise keep the first min(top_k, k) candidates (all k when top_k <= 0), softmax at the
temperature, keep the smallest prefix whose mass reaches top_p, and pick by inverse transform:
the first candidate whose cumulative mass exceeds u times the kept mass (u defaults to 0.5, the
kernel's compiled-in draw).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import parallel
from .decode import per_core, rms_norm

GREEDY_BELOW = 1e-5
DEFAULT_DRAW = 0.5


@dataclass
class TailOut:
    tokens: torch.Tensor | None  # [rows] (None when no sampling params)
    topk_values: torch.Tensor  # [rows, k] fp32 (bf16-exact)
    topk_indices: torch.Tensor  # [rows, k]
    logits: torch.Tensor | None  # [gbs, V_s] fp32, this rank's vocab slice (emit_logits)


def lm_head(hidden: torch.Tensor, gamma: torch.Tensor, w_t: torch.Tensor, eps: float, hidden_actual: int,
            matmul=lambda x, w: x @ w.to(torch.float32)):
    """``matmul``: how ``x @ w`` is made (``by_columns`` where eager)."""
    h = rms_norm(hidden, gamma, eps, hidden_actual)
    return matmul(h.to(torch.bfloat16).to(torch.float32), w_t)


def by_columns(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` in float32, a block of w's columns a core (eager only: verify's 128 vocab ranks
    each multiply a [positions, Hp] x [Hp, V/128] slice inside one-thread greenlets); each column's
    sum is the one matmul makes."""
    out = torch.empty(x.shape[0], w.shape[1], device=x.device)
    step = per_core(w.shape[1])

    def block(j: int) -> None:
        out[:, j:j + step] = x @ w[:, j:j + step].to(torch.float32)

    parallel.each(block, range(0, w.shape[1], step))
    return out


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest, in the order of a stable descending sort (ties: the lower index first).
    Eager (verify's 128 vocab ranks at every position), row by row through ``leading``."""
    if torch.compiler.is_compiling() or x.dim() != 2 or not len(x):
        v, i = torch.sort(x, dim=-1, descending=True, stable=True)
        return v[..., :k], i[..., :k]
    i = torch.stack([leading(row, k) for row in x])
    return x.gather(1, i), i


def leading(ref: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` indices of ``ref``'s stable descending sort (ties in index order), without
    sorting the whole vocabulary: the top-k's k-th value bounds them, so only those above it and the
    lowest-indexed ties at it are sorted (a 201,088-entry sort a position was most of compare's time)."""
    if k >= ref.numel() or torch.isnan(ref).any():  # NaN: the full sort's own placement
        return torch.argsort(ref, descending=True, stable=True)[:k]
    edge = torch.topk(ref, k).values[-1]
    above = torch.nonzero(ref > edge).flatten()
    ties = torch.nonzero(ref == edge).flatten()[:k - len(above)]
    chosen = torch.cat([above, ties]).sort().values  # index order, so the stable sort keeps ties so
    return chosen[torch.argsort(ref[chosen], descending=True, stable=True)]


def sample(values: torch.Tensor, indices: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Tokens for each row from its sorted candidates and [top_k, top_p, temperature, (u)]."""
    n = values.shape[1]
    top_k, top_p, temp = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    u = params[:, 3:4] if params.shape[1] > 3 else torch.full_like(top_p, DEFAULT_DRAW)
    rank = torch.arange(n, device=values.device)[None, :]
    keep_k = rank < torch.where(top_k > 0, top_k.clamp(max=n), torch.full_like(top_k, n))
    logits = (values / temp.clamp(min=GREEDY_BELOW)).masked_fill(~keep_k, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    cum = torch.cumsum(p, dim=-1)
    keep_p = (cum - p) < top_p  # the smallest prefix whose mass reaches top_p
    p = p.masked_fill(~keep_p, 0.0)
    cdf = torch.cumsum(p, dim=-1)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=n - 1)
    pick = torch.where(temp < GREEDY_BELOW, torch.zeros_like(pick), pick)
    return indices.gather(1, pick).squeeze(1)


def exchange(rows: torch.Tensor, comm, hops: int, batch_groups: int = 1) -> torch.Tensor:
    """The all-to-all from vocab-parallel to batch-parallel: hop by hop; or, with G batch groups
    (single hop), one exchange per group of gbs/G rows, so this rank receives its rows of every
    group in group order (``owned_rows``'s strided set)."""
    if batch_groups == 1:
        for h in range(hops):
            rows = comm.all_to_all(rows, ("hop", h))
        return rows
    return torch.cat([comm.all_to_all(g, ("hop", 0)) for g in rows.chunk(batch_groups, dim=0)], dim=0)


def step(hidden: torch.Tensor, gamma: torch.Tensor, w_t: torch.Tensor, comm, hops: int, k: int, eps: float,
         hidden_actual: int, params: torch.Tensor | None = None, emit_logits: bool = True,
         batch_groups: int = 1) -> TailOut:
    """One tail call of this vocab rank; ``hidden`` is the whole batch."""
    logits = lm_head(hidden, gamma, w_t, eps, hidden_actual)
    rows = exchange(logits.to(torch.bfloat16), comm, hops, batch_groups)
    values, indices = stable_topk(rows.to(torch.float32), k)
    tokens = sample(values, indices, params) if params is not None else None
    return TailOut(tokens, values, indices, logits if emit_logits else None)
