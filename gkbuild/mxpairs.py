"""One lookup a packed MXFP4 byte, its block's scale included: the lookup the golden and the twins share.

A block is 16 bytes (32 e2m1 values) under one E8M0 scale byte. A table ``pairs`` [65536, 2] float32
holds at ``s << 8 | b`` the two values byte ``b`` decodes to at scale ``s``, low nibble first. Each side
fills its own table from its own definition (``hf_mxfp4``: transformers' function; ``kernels.mx``: the
kernel's reference), so the two decodes stay independent; only the lookup is shared.

The lookup is a compiled loop (numba): a value pair is copied as one 8-byte word, a block's 16
lookups fall in one scale's 2 KiB of the table, and nothing but the output is written. numpy's
``take`` needed an index array first (the u16 ``s << 8 | b`` a byte, widened to intp inside it) and
ran ~4x slower (issue 28: bench/bench_hf_mxfp4.py). The loop is compiled on first use and cached
beside this module (numba's ``cache=True``; a read-only install falls back to numba's user cache),
and it releases the GIL: the reference's and verify's threads look up side by side.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def _kernel():
    from numba import njit

    @njit(nogil=True, cache=True)
    def lookup(table, blocks, scales, into):  # pragma: no cover (compiled: coverage cannot see it)
        """into[i, m] = table[scales[i] << 8 | blocks[i, m]]: [N, 16] int64 words from [N, 16] u8 + [N] u8."""
        for i in range(scales.shape[0]):
            base = np.int64(scales[i]) << 8
            for m in range(16):
                into[i, m] = table[base | np.int64(blocks[i, m])]

    return lookup


def take(pairs: np.ndarray, blocks: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """blocks [..., 16] u8 + scales [...] u8 -> [..., 32] float32 through ``pairs`` [65536, 2] float32
    (into ``out``, a contiguous float32 array of that many elements, when given)."""
    if pairs.shape != (1 << 16, 2) or pairs.dtype != np.float32:
        raise ValueError(f"pairs must be [65536, 2] float32, got {list(pairs.shape)} {pairs.dtype}")
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape != scales.shape + (16,):
        raise ValueError(f"blocks [..., 16] u8 and scales [...] u8 expected, got {list(blocks.shape)} {blocks.dtype}"
                         f" and {list(scales.shape)} {scales.dtype}")
    n = scales.size
    if out is None:
        out = np.empty((n, 32), np.float32)
    if out.dtype != np.float32 or out.size != n * 32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 array of {n * 32} elements")
    table = np.ascontiguousarray(pairs).view(np.int64).reshape(-1)
    _kernel()(table, blocks.reshape(n, 16), scales.reshape(n), out.reshape(n, 32).view(np.int64))
    return out.reshape(scales.shape + (32,))
