"""Array moves for the layout functions, fast on large tensors.

A plain ``ascontiguousarray(a.T)`` walks the source column by column (~0.2-1 GB/s here); copying
256-row blocks keeps both sides in cache. Permutes whose innermost run stays contiguous
are left to numpy's strided copy. Everything returns new C-contiguous arrays of the same dtype.
"""

from __future__ import annotations

import sys

import numpy as np

assert sys.byteorder == "little", "the MX u16 packing (bytes 2c, 2c+1) assumes a little-endian host"

_BLOCK_ROWS = 256  # 64 spent a third of the time in numpy call overhead on the 120b shapes


def permute(a: np.ndarray, shape: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    """``a`` viewed as ``shape``, its axes permuted, copied C-contiguous."""
    return np.ascontiguousarray(np.asarray(a).reshape(shape).transpose(axes))


def transpose(a: np.ndarray) -> np.ndarray:
    """The C-contiguous transpose of the last two axes, copied in cache-sized row blocks."""
    a = np.asarray(a)
    rows, cols = a.shape[-2:]
    src = a.reshape((-1, rows, cols))
    out = np.empty((src.shape[0], cols, rows), a.dtype)
    for i in range(src.shape[0]):
        for r in range(0, rows, _BLOCK_ROWS):
            out[i, :, r:r + _BLOCK_ROWS] = src[i, r:r + _BLOCK_ROWS].T
    return out.reshape(a.shape[:-2] + (cols, rows))
