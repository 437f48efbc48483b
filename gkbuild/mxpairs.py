"""One lookup a packed MXFP4 byte, its block's scale included: the lookup the golden and the twins share.

A block is 16 bytes (32 e2m1 values) under one E8M0 scale byte. A table ``pairs`` [65536, 2] float32
holds at ``s << 8 | b`` the two values byte ``b`` decodes to at scale ``s``, low nibble first. Each side
fills its own table from its own definition (``hf_mxfp4``: transformers' function; ``kernels.mx``: the
kernel's reference), so the two decodes stay independent; only the lookup is shared. No pass multiplies
the scale in, a block's lookups fall in one scale's 2 KiB of the table, and the indices are made and
used a few thousand blocks at a time, so they stay in cache (numpy's take widens u16 indices to intp).
"""

from __future__ import annotations

import numpy as np

CHUNK = 4096  # blocks an index buffer holds: 128 KiB of u16, 512 KiB of intp as take widens them


def take(pairs: np.ndarray, blocks: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """blocks [..., 16] u8 + scales [...] u8 -> [..., 32] float32 through ``pairs`` [65536, 2] float32
    (into ``out``, a contiguous float32 array of that many elements, when given)."""
    b, lift = blocks.reshape(-1, 16), scales.astype(np.uint16).reshape(-1, 1) << 8
    n = len(lift)
    if out is None:
        out = np.empty((n, 32), np.float32)
    into, table = out.reshape(n, 32).view(np.int64), pairs.view(np.int64).reshape(-1)
    at = np.empty((min(n, CHUNK), 16), np.uint16)
    for i in range(0, n, CHUNK):
        a = at[:min(CHUNK, n - i)]
        np.bitwise_or(lift[i:i + CHUNK], b[i:i + CHUNK], out=a)  # u16: no index can miss the table
        # "clip" never clips (every u16 is a row), and unlike "raise" fills ``into`` unbuffered
        np.take(table, a, out=into[i:i + CHUNK], mode="clip")
    return out.reshape(scales.shape + (32,))
