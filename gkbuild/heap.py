"""Large temporaries from the heap, reused, instead of fresh mappings (glibc).

glibc serves a block above its mmap threshold (at most 32 MiB) with a fresh mmap and returns it on
free, so each new block's pages are faulted in and zeroed by the kernel again. Verify and the
reference make such blocks thousands of times (one 120b expert dequantized is ~113 MB): measured,
a 120b expert's decode and matmuls took 264 ms with fresh mappings and 71 ms with the heap reused
(bench/RESULTS.md). Called once by those commands; a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LIMIT = 1 << 30  # blocks up to 1 GiB come from the heap; the heap keeps up to 1 GiB free at its top


@functools.cache
def reuse_large_blocks() -> bool:
    """Keep large blocks in the heap for reuse; True if the C library took the setting."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LIMIT)) and bool(mallopt(M_TRIM_THRESHOLD, LIMIT))
