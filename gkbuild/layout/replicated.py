"""Tensors every rank holds whole: norms, the O-projection bias, the router, final norm (the embedding
has its own placements: ``embedding.py``)."""

from __future__ import annotations

import numpy as np

from . import arrays, hidden
from .dims import Dims


def row(dims: Dims, v: np.ndarray) -> np.ndarray:
    """A hidden-sized vector (norm weight, o_proj bias) -> [1, Hp] in kernel lanes, same dtype."""
    return hidden.to_kernel(v, 0, dims.Hp)[None, :]


def row_inverse(dims: Dims, r: np.ndarray) -> np.ndarray:
    return hidden.from_kernel(r[0], 0, dims.H)


def router_weights(dims: Dims, w: np.ndarray) -> np.ndarray:
    """HF router [E, H] bf16 -> [Hp, E] fp16 (exact for |w| in fp16's normal range)."""
    return arrays.f32(hidden.to_kernel_t(w, dims.Hp)).astype(np.float16)


def router_weights_inverse(dims: Dims, r: np.ndarray, dtype) -> np.ndarray:
    return np.ascontiguousarray(hidden.from_kernel(r.T, 1, dims.H)).astype(dtype)


def router_bias(b: np.ndarray) -> np.ndarray:
    """HF router bias [E] -> [1, E] fp16."""
    return arrays.f32(b).astype(np.float16)[None, :]


def router_bias_inverse(r: np.ndarray, dtype) -> np.ndarray:
    return r[0].astype(dtype)


def gamma(dims: Dims, norm: np.ndarray) -> np.ndarray:
    """The final norm [H] bf16 -> the tail's gamma [1, Hp] fp32 (exact)."""
    return row(dims, arrays.f32(norm))


def gamma_inverse(dims: Dims, g: np.ndarray, dtype) -> np.ndarray:
    return row_inverse(dims, g).astype(dtype)
