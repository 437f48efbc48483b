"""Dequantized (bf16) experts in the layout of the nki-library MoE TKG bf16 path, one layer.

- gate_up weight [E_L, Hp, 2, Ip] bf16: W[e, x, g, j] = dq_gate_up[e, 2j+g, sigma(x)] (gate g=0
  from the even HF rows, up g=1 from the odd ones, de-interleaved; intermediate in natural order)
- gate_up bias [E_L, 2, Ip] fp32: B[e, g, j] = bias[e, 2j+g] (+1 on up for j < I)
- down weight [E_L, Ip, Hp] bf16: D[e, j, x] = dq_down[e, sigma(x), j]
- down bias [E_L, Hp] fp32

Every e2m1 * 2^k value is exact in bf16, so the dequantization loses nothing; zero padding on both
axes as for the MX layout.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import dtype
from . import arrays, hidden
from .dims import Dims
from .scalars import UP_BIAS_SHIFT


def gate_up_weights(dims: Dims, w: np.ndarray) -> np.ndarray:
    """Dequantized HF gate_up [E_L, 2I, H] (float) -> [E_L, Hp, 2, Ip] bf16."""
    E_L = w.shape[0]
    p = hidden.to_kernel(hidden.pad(w.astype(dtype("bf16").numpy), 1, 2 * dims.Ip), 2, dims.Hp)  # [E_L, 2Ip, x]
    return np.ascontiguousarray(p.reshape(E_L, dims.Ip, 2, dims.Hp).transpose(0, 3, 2, 1))


def gate_up_bias(dims: Dims, bias: np.ndarray) -> np.ndarray:
    """HF gate_up bias [E_L, 2I] -> [E_L, 2, Ip] fp32, +1 folded into up."""
    E_L = bias.shape[0]
    b = hidden.pad(arrays.f32(bias), 1, 2 * dims.Ip).reshape(E_L, dims.Ip, 2).copy()
    b[:, :dims.I, 1] += np.float32(UP_BIAS_SHIFT)
    return np.ascontiguousarray(b.transpose(0, 2, 1))


def gate_up(dims: Dims, w: np.ndarray, bias: np.ndarray):
    """Dequantized HF gate_up [E_L, 2I, H] (float) + bias [E_L, 2I] -> (W, B)."""
    return gate_up_weights(dims, w), gate_up_bias(dims, bias)


def gate_up_inverse(dims: Dims, W: np.ndarray, B: np.ndarray, bias_dtype):
    E_L = W.shape[0]
    p = W.transpose(0, 3, 2, 1).reshape(E_L, 2 * dims.Ip, dims.Hp)
    w = hidden.unpad(hidden.from_kernel(p, 2, dims.H), 1, 2 * dims.I)
    b = B.transpose(0, 2, 1).copy()
    b[:, :dims.I, 1] -= np.float32(UP_BIAS_SHIFT)
    return w, hidden.unpad(b.reshape(E_L, 2 * dims.Ip), 1, 2 * dims.I).astype(bias_dtype)


def down_weights(dims: Dims, w: np.ndarray) -> np.ndarray:
    """Dequantized HF down [E_L, H, I] (float) -> [E_L, Ip, Hp] bf16."""
    return arrays.transpose(hidden.to_kernel(hidden.pad(w.astype(dtype("bf16").numpy), 2, dims.Ip), 1, dims.Hp))


def down_bias(dims: Dims, bias: np.ndarray) -> np.ndarray:
    """HF down bias [E_L, H] -> [E_L, Hp] fp32 in kernel lanes."""
    return hidden.to_kernel(arrays.f32(bias), 1, dims.Hp)


def down(dims: Dims, w: np.ndarray, bias: np.ndarray):
    """Dequantized HF down [E_L, H, I] (float) + bias [E_L, H] -> (D, B)."""
    return down_weights(dims, w), down_bias(dims, bias)


def down_inverse(dims: Dims, D: np.ndarray, B: np.ndarray, bias_dtype):
    w = hidden.unpad(hidden.from_kernel(D.transpose(0, 2, 1), 1, dims.H), 2, dims.I)
    return w, hidden.from_kernel(B, 1, dims.H).astype(bias_dtype)
