"""Attention weights per TP rank: fused, transposed QKV; the O projection's rows; the sinks.

TP rank t holds q heads [t*q_l, (t+1)*q_l) and the kv heads they attend with (``Dims.kv_heads_of``;
replicated when tp exceeds the kv heads). Hidden axes are in kernel lane order.
"""

from __future__ import annotations

import numpy as np

from ..errors import GkError
from . import arrays, hidden, replicated
from .dims import Dims


def heads(dims: Dims, t: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """TP rank t's q heads [q0, q1) and kv heads [k0, k1). Both are contiguous, so a rank reads
    only its rows of q/k/v (head h is rows [h*d, (h+1)*d)) and of the sinks."""
    qh, kh = dims.q_heads_of(t), dims.kv_heads_of(t)
    return (qh[0], qh[-1] + 1), (kh[0], kh[-1] + 1)


def qkv_weight(dims: Dims, q_w, k_w, v_w) -> np.ndarray:
    """A TP rank's rows (``heads``) of the HF q/k/v weights -> W_qkv [Hp, (q_l+2kv_l)*d]."""
    return hidden.to_kernel_t(np.concatenate([q_w, k_w, v_w]), dims.Hp)


def qkv_bias(q_b, k_b, v_b) -> np.ndarray:
    """A TP rank's rows (``heads``) of the HF q/k/v biases -> bias_qkv [1, (q_l+2kv_l)*d]."""
    return np.concatenate([q_b, k_b, v_b])[None, :]


def qkv_inverse(dims: Dims, shards: list[tuple[np.ndarray, np.ndarray]]):
    """All TP ranks' (W_qkv, bias_qkv) -> HF (q_w, k_w, v_w, q_b, k_b, v_b).

    A replicated kv head is taken from the first rank that holds it; the copies must agree.
    """
    d = dims.d
    q_w = [None] * dims.q
    q_b = [None] * dims.q
    k_w, k_b, v_w, v_b = ([None] * dims.kv for _ in range(4))
    for t, (W, B) in enumerate(shards):
        w = hidden.from_kernel(W.T, 1, dims.H)
        b = B[0]
        qh, kh = dims.q_heads_of(t), dims.kv_heads_of(t)
        for i, h in enumerate(qh):
            q_w[h], q_b[h] = w[i * d:(i + 1) * d], b[i * d:(i + 1) * d]
        off = len(qh) * d
        for kind_w, kind_b, base in ((k_w, k_b, off), (v_w, v_b, off + len(kh) * d)):
            for i, h in enumerate(kh):
                rw, rb = w[base + i * d:base + (i + 1) * d], b[base + i * d:base + (i + 1) * d]
                if kind_w[h] is None:
                    kind_w[h], kind_b[h] = rw, rb
                elif not (np.array_equal(kind_w[h].view(np.uint16), rw.view(np.uint16))
                          and np.array_equal(kind_b[h].view(np.uint16), rb.view(np.uint16))):
                    raise ValueError(f"replicas of kv head {h} differ between TP ranks")
    cat = np.concatenate
    return cat(q_w), cat(k_w), cat(v_w), cat(q_b), cat(k_b), cat(v_b)


def w_out(dims: Dims, t: int, o_w: np.ndarray, v_scale: float = 1.0) -> np.ndarray:
    """HF o_proj [H, q*d] -> W_out [q_l*d, Hp] for TP rank t, the FP8 V dequant scale folded in."""
    cols = o_w[:, t * dims.q_l * dims.d:(t + 1) * dims.q_l * dims.d]
    w = arrays.transpose(hidden.to_kernel(cols, 0, dims.Hp))
    if v_scale != 1.0:
        with np.errstate(over="ignore", under="ignore"):  # judged below, in one line
            folded = arrays.like_bf16(arrays.f32(w) * np.float32(v_scale), w)
        check_fold(w, folded, f"W_out with kv_cache.v_scale {v_scale!r} folded in")
        w = folded
    return w


def check_fold(before: np.ndarray, after: np.ndarray, what: str) -> None:
    """A fold of a scale into weights must stay in the weights' range: every value finite, and no
    value that was not zero flushed to zero (an extreme scale would make a build of inf, NaN or
    zeros that loads and runs). bf16 comes as itself or as its u16 bits (``arrays.f32``)."""
    a = arrays.f32(after)
    if not np.isfinite(a).all():
        raise GkError(f"{what}: overflows bf16 (non-finite values); the scale is out of range")
    if np.any((a == 0) & (arrays.f32(before) != 0)):
        raise GkError(f"{what}: underflows bf16 (values flushed to zero); the scale is out of range")


def w_out_inverse(dims: Dims, shards: list[np.ndarray], v_scale: float = 1.0) -> np.ndarray:
    """All TP ranks' W_out -> HF o_proj [H, q*d] (exact when v_scale is a power of two)."""
    w = np.concatenate(shards, axis=0)
    if v_scale != 1.0:
        w = (w.astype(np.float32) / np.float32(v_scale)).astype(w.dtype)
    return np.ascontiguousarray(hidden.from_kernel(w.T, 0, dims.H))


def o_bias(dims: Dims, b: np.ndarray) -> np.ndarray:
    """HF o_proj bias [H] -> bias_out [1, Hp], divided by tp: every TP rank adds it to its partial
    output before the reduce-scatter sums the partials (exact when tp is a power of two)."""
    return replicated.row(dims, arrays.like_bf16(arrays.f32(b) / np.float32(dims.tp), b))


def o_bias_inverse(dims: Dims, r: np.ndarray) -> np.ndarray:
    return (replicated.row_inverse(dims, r).astype(np.float32) * np.float32(dims.tp)).astype(r.dtype)


def sink(sinks: np.ndarray) -> np.ndarray:
    """A TP rank's HF sinks (its q heads, ``heads``) -> [q_l, 1]."""
    return np.ascontiguousarray(sinks[:, None])


def sink_inverse(shards: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([s[:, 0] for s in shards])

