"""The hidden axis in kernel order: padded to Hp with interleaved zero lanes.

Kernel lane x holds padded-HF hidden index sigma(x) = 4*(x mod Hp/4) + x // (Hp/4): the padded
axis viewed [Hp/4, 4] is transposed to [4, Hp/4], so each of the 4 lane groups ends in
(Hp - H)/4 zero lanes (the tail kernel's ``zero_interleaved_pad``). Every hidden-axis tensor uses
this order, so the residual stream is in it end to end; RMSNorm divides by the real H.
"""

from __future__ import annotations

import numpy as np

from . import arrays


def sigma(Hp: int) -> np.ndarray:
    """sigma[x]: the padded-HF hidden index kernel lane x holds."""
    x = np.arange(Hp)
    return 4 * (x % (Hp // 4)) + x // (Hp // 4)


def pad_lanes(H: int, Hp: int) -> np.ndarray:
    """Boolean mask of kernel lanes that are padding."""
    return sigma(Hp) >= H


def pad(x: np.ndarray, axis: int, n: int) -> np.ndarray:
    """Append zeros along ``axis`` up to length ``n`` (a no-op view when already that long)."""
    have = x.shape[axis]
    if have == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - have)
    return np.pad(x, widths)


def unpad(x: np.ndarray, axis: int, n: int, strict: bool = True) -> np.ndarray:
    """Inverse of :func:`pad`; ``strict`` checks the dropped entries are all-zero bytes."""
    axis %= x.ndim
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(n, None)
    if strict and np.any(np.ascontiguousarray(x[tuple(idx)]).view(np.uint8)):
        raise ValueError(f"padding along axis {axis} is not zero")
    idx[axis] = slice(0, n)
    return x[tuple(idx)]


def to_kernel(x: np.ndarray, axis: int, Hp: int) -> np.ndarray:
    """HF hidden order (length H) -> kernel lanes (length Hp), C-contiguous.

    One pass: the output is allocated as [.., 4, Hp/4, ..], each lane group is filled from its
    stride-4 column of the input, and only the padding lanes are zeroed.
    """
    axis %= x.ndim
    H = _check(x.shape[axis], Hp)
    before, after = x.shape[:axis], x.shape[axis + 1:]
    src = arrays.bits(x).reshape(before + (H // 4, 4) + after)
    out = np.empty(before + (4, Hp // 4) + after, src.dtype)
    lead = (slice(None),) * axis
    out[lead + (slice(None), slice(H // 4, None))] = 0
    for g in range(4):
        out[lead + (g, slice(0, H // 4))] = src[lead + (slice(None), g)]
    return out.reshape(before + (Hp,) + after).view(x.dtype)


def to_kernel_t(x: np.ndarray, Hp: int) -> np.ndarray:
    """[R, H] -> [Hp, R]: ``to_kernel(x.T, 0, Hp)`` in one blocked pass (a weight whose hidden
    axis is its input: the transpose and the lane shuffle move each element once)."""
    R, H = x.shape
    _check(H, Hp)
    src = arrays.bits(x).reshape(R, H // 4, 4)
    out = np.empty((4, Hp // 4, R), src.dtype)
    out[:, H // 4:] = 0
    for r in range(0, R, arrays.BLOCK_ROWS):
        out[:, :H // 4, r:r + arrays.BLOCK_ROWS] = src[r:r + arrays.BLOCK_ROWS].transpose(2, 1, 0)
    return out.reshape(Hp, R).view(x.dtype)


def _check(H: int, Hp: int) -> int:
    if H % 4 or Hp % 4 or Hp < H:
        raise ValueError(f"cannot lay hidden {H} out in {Hp} lanes")
    return H


def from_kernel(x: np.ndarray, axis: int, H: int, strict: bool = True) -> np.ndarray:
    """Inverse of :func:`to_kernel`."""
    axis %= x.ndim
    Hp = x.shape[axis]
    shape = x.shape[:axis] + (4, Hp // 4) + x.shape[axis + 1:]
    p = np.ascontiguousarray(np.swapaxes(x.reshape(shape), axis, axis + 1)).reshape(x.shape)
    return unpad(p, axis, H, strict)
