"""MXFP4 as the GPT-OSS checkpoints store it: blocks of 32 along the input axis.

``blocks`` [..., G, 16] u8: element 2j of a block is the LOW nibble of byte j, 2j+1 the HIGH
nibble; each nibble is an e2m1 code. ``scales`` [..., G] u8 is an E8M0 exponent: value =
e2m1 * 2^(scale - 127); 255 is NaN.
"""

from __future__ import annotations

import numpy as np

from ..errors import GkError

BLOCK = 32  # elements per scale
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
_MAG = E2M1[:8]
_MID = (_MAG[1:] + _MAG[:-1]) / 2  # rounding boundaries between neighbouring magnitudes
SCALE_NAN = 255


def check_scales(scales: np.ndarray, where: str) -> None:
    """E8M0 255 is NaN: no real checkpoint has one, so it means corruption."""
    flat = np.asarray(scales).reshape(-1)
    if flat.size and flat.max() == SCALE_NAN:  # one vectorized pass; locate only on failure
        bad = np.flatnonzero(flat == SCALE_NAN)
        raise GkError(f"{where}: {bad.size} MXFP4 scale byte(s) are 255 (NaN in E8M0), "
                      f"first at flat index {int(bad[0])}")


def unpack_codes(blocks: np.ndarray) -> np.ndarray:
    """[..., G, 16] u8 -> [..., G*32] e2m1 codes (u8), in element order."""
    b = np.asarray(blocks, dtype=np.uint8)
    codes = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    np.bitwise_and(b, 0x0F, out=codes[..., 0::2])
    np.right_shift(b, 4, out=codes[..., 1::2])
    return codes.reshape(b.shape[:-2] + (b.shape[-2] * b.shape[-1] * 2,))


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Inverse of :func:`unpack_codes`: [..., n] codes -> [..., n/32, 16] u8."""
    c = np.asarray(codes, dtype=np.uint8)
    n = c.shape[-1]
    if n % BLOCK:
        raise ValueError(f"last axis {n} is not a multiple of {BLOCK}")
    packed = (c[..., 0::2] & 0x0F) | (c[..., 1::2] << 4)
    return packed.reshape(c.shape[:-1] + (n // BLOCK, BLOCK // 2))


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] u8 blocks + [..., G] u8 scales -> [..., G*32] float32 (exact)."""
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"blocks {blocks.shape} and scales {scales.shape} do not pair up")
    vals = E2M1[unpack_codes(blocks)].reshape(scales.shape + (BLOCK,))
    exp = scales.astype(np.int32) - 127
    out = np.ldexp(vals, exp[..., None])
    out[np.broadcast_to((scales == SCALE_NAN)[..., None], out.shape)] = np.nan
    return out.reshape(scales.shape[:-1] + (scales.shape[-1] * BLOCK,))


def encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., n] -> (blocks [..., n/32, 16] u8, scales [..., n/32] u8).

    Scale: the smallest power of two that brings the block's max magnitude within 6.0.
    Elements round to the nearest e2m1 value, ties to the even code; the sign of zero is kept.
    """
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"last axis {n} is not a multiple of {BLOCK}")
    xb = x.reshape(x.shape[:-1] + (n // BLOCK, BLOCK))
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax / np.float32(6.0)))
    e = np.where(amax > 0, e, -127).clip(-127, 127).astype(np.int32)
    q = np.abs(np.ldexp(xb, -e[..., None]))
    idx = np.searchsorted(_MID, q, side="left")
    tie = (idx < len(_MID)) & (q == _MID[np.minimum(idx, len(_MID) - 1)]) & (idx % 2 == 1)
    idx = (idx + tie).astype(np.uint8)
    codes = idx | (np.signbit(xb).astype(np.uint8) << 3)
    blocks = pack_codes(codes.reshape(x.shape))
    return blocks, (e + 127).astype(np.uint8)
