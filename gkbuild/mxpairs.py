"""One lookup a packed MXFP4 byte, its block's scale included: the lookup the golden and the twins share.

A block is 16 bytes (32 e2m1 values) under one E8M0 scale byte. A table ``pairs`` [65536, 2] float32
holds at ``s << 8 | b`` the two values byte ``b`` decodes to at scale ``s``, low nibble first. Each side
fills its own table from its own definition (``hf_mxfp4``: transformers' function; ``kernels.mx``: the
kernel's reference), so the two decodes stay independent; only the lookup is shared.

The lookup is a compiled loop (numba) over a block's 8 little-endian u16 words, read where they lie
(any strides: the twins read an MX tile across its rows, the transpose of how it is stored, without
copying it first; a u16's low byte holds nibbles 0 and 1): a value pair is copied as one 8-byte
word, a block's 16 lookups fall in one scale's 2 KiB of the table, and nothing but the output is
written. numpy's ``take`` needed an index array first (the u16 ``s << 8 | b`` a byte, widened to
intp inside it) and ran ~4x slower, and the twins' tile transpose was a copy of its own, its pages
fresh each expert (issue 28: bench/bench_hf_mxfp4.py). The loop is compiled on first use in each process
(0.1-0.3 s a layout: the golden's contiguous words, the twins' strided ones) and releases the GIL:
the reference's and verify's threads look up side by side. Not numba's on-disk cache (``cache=True``):
its index is rewritten without a lock and a loaded entry is not checked against the signature that
asked for it (numba issue #4807), so two processes filling it at once (``make test``'s two workers)
could hand the strided layout code compiled for contiguous arrays: wrong words, read past a view's
end; and with no writable cache folder at all (a read-only install, no home) it raises.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def _kernel():
    from numba import njit

    @njit(nogil=True)
    def lookup(table, words, scales, into):  # pragma: no cover (compiled: coverage cannot see it)
        """into[k] = the 16 pairs of block k: words [A, B, C, D, 8] u16 + scales [A, B, C, D] u8, any
        strides, blocks in index order -> into [A*B*C*D, 16] int64."""
        A, B, C, D = scales.shape
        k = 0
        for a in range(A):
            for b in range(B):
                for c in range(C):
                    for d in range(D):
                        base = np.int64(scales[a, b, c, d]) << 8
                        for q in range(8):
                            w = np.int64(words[a, b, c, d, q])
                            into[k, 2 * q] = table[base | (w & 0xFF)]
                            into[k, 2 * q + 1] = table[base | (w >> 8)]
                        k += 1

    return lookup


def _four(x: np.ndarray, tail: int) -> np.ndarray:
    """x with its leading axes (all but ``tail``) made exactly four: unit axes added in front, or
    the first ones merged (a copy only where their strides do not merge)."""
    lead = x.ndim - tail
    if lead > 4:
        return x.reshape(-1, *x.shape[lead - 3:])
    return x.reshape((1,) * (4 - lead) + x.shape)


def take(pairs: np.ndarray, words: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """words [..., 8] u16 (a block's 16 bytes, little-endian words; any strides) + scales [...] u8 ->
    [..., 32] float32 through ``pairs`` [65536, 2] float32 (into ``out``, a contiguous float32 array
    of that many elements, when given)."""
    if pairs.shape != (1 << 16, 2) or pairs.dtype != np.float32:
        raise ValueError(f"pairs must be [65536, 2] float32, got {list(pairs.shape)} {pairs.dtype}")
    if words.dtype != np.uint16 or scales.dtype != np.uint8 or words.shape != scales.shape + (8,):
        raise ValueError(f"words [..., 8] u16 and scales [...] u8 expected, got {list(words.shape)} {words.dtype}"
                         f" and {list(scales.shape)} {scales.dtype}")
    n = scales.size
    if out is None:
        out = np.empty((n, 32), np.float32)
    if out.dtype != np.float32 or out.size != n * 32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 array of {n * 32} elements")
    table = np.ascontiguousarray(pairs).view(np.int64).reshape(-1)
    _kernel()(table, _four(words, 1), _four(scales, 0), out.reshape(n, 32).view(np.int64))
    return out.reshape(scales.shape + (32,))
