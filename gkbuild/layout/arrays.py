"""Array moves for the layout functions, fast on large tensors.

A plain ``ascontiguousarray(a.T)`` walks the source column by column (~0.2-1 GB/s here); copying
256-row blocks keeps both sides in cache. Permutes whose innermost run stays contiguous
are left to numpy's strided copy. Everything returns new C-contiguous arrays of the same dtype,
moved as unsigned integers of its width (``bits``).
"""

from __future__ import annotations

import sys

import numpy as np

assert sys.byteorder == "little", "the MX u16 packing (bytes 2c, 2c+1) assumes a little-endian host"

BLOCK_ROWS = 256  # 64 spent a third of the time in numpy call overhead on the 120b shapes


def bits(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as unsigned integers of its item size. numpy moves those with its own tight
    loops; a bf16 (ml_dtypes) array's strided copies went through a per-element copyswap instead."""
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def permute(a: np.ndarray, shape: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    """``a`` viewed as ``shape``, its axes permuted, copied C-contiguous."""
    a = np.asarray(a)
    return np.ascontiguousarray(bits(a).reshape(shape).transpose(axes)).view(a.dtype)


def transpose(a: np.ndarray) -> np.ndarray:
    """The C-contiguous transpose of the last two axes, copied in cache-sized row blocks."""
    a = np.asarray(a)
    rows, cols = a.shape[-2:]
    src = bits(a).reshape((-1, rows, cols))
    out = np.empty((src.shape[0], cols, rows), src.dtype)
    for i in range(src.shape[0]):
        for r in range(0, rows, BLOCK_ROWS):
            out[i, :, r:r + BLOCK_ROWS] = src[i, r:r + BLOCK_ROWS].T
    return out.reshape(a.shape[:-2] + (cols, rows)).view(a.dtype)
