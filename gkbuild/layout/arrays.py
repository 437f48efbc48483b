"""Array moves for the layout functions, fast on large tensors.

A plain ``ascontiguousarray(a.T)`` walks the source column by column (~0.2-1 GB/s here); copying
256-row blocks keeps both sides in cache. Permutes whose innermost run stays contiguous
are left to numpy's strided copy. Everything returns new C-contiguous arrays of the same dtype,
moved as unsigned integers of its width (``bits``). A build reads bf16 as its u16 bits (no
ml_dtypes); ``f32`` and ``like_bf16`` convert either form exactly as ml_dtypes does.
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


def f32(a: np.ndarray) -> np.ndarray:
    """A float array as float32, exactly; u16 is taken as the bits of bf16 (the upper half of a float32)."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def like_bf16(x: np.ndarray, like: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bf16 in ``like``'s form: its dtype (ml_dtypes bf16), or, for u16
    bits, rounded to nearest even as ml_dtypes rounds (a NaN becomes its quiet NaN of the same sign)."""
    if like.dtype != np.uint16:
        return x.astype(like.dtype)
    b = np.asarray(x, np.float32).view(np.uint32)
    out = ((b + (np.uint32(0x7FFF) + ((b >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((b[nan] >> 16) & 0x8000).astype(np.uint16) | np.uint16(0x7FC0)
    return out
