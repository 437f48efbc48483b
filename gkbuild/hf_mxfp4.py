"""The reference's MXFP4 experts: transformers' own dequantization, made fast by tabulating it.

The reference must not decode MXFP4 with the build's code (``checkpoint.mxfp4``, ``kernels.mx``):
a bug there would then be in both and invisible to verify. GPT-OSS's published path is
``convert_moe_packed_tensors`` in transformers' ``integrations/mxfp4.py`` (5.24.0, lines 229-310):
a 16-entry e2m1 table (``FP4_VALUES``) indexed by the low nibble of each block byte into element
2j and by the high nibble into 2j+1, then ``torch.ldexp`` by ``scale - 127``, rows flattened and
the last two axes transposed. At 120b widths it costs ~0.3 s an expert here, and a 36-layer
golden uses ~20,000 expert matrices.

So this module calls that function once on inputs that enumerate its whole domain, and keeps the
answers as two tables:

- ``quad[u]``: the four values transformers puts at elements 4c..4c+3 of a block row for the
  little-endian u16 ``u`` of bytes 2c, 2c+1 (every one of the 65536 byte pairs, scale 127);
- ``factor[s]``: the value of a 1.0 element at scale byte ``s`` (every s in 0..254; 255 is NaN in
  E8M0 and refused when the checkpoint is read).

``dense`` decodes a block row range as ``quad[u16] * factor[scale]``. That this equals
transformers' ldexp for every (code, scale) pair is checked once (all 16 codes x 255 scales), and
``check_layout`` compares ``dense`` with a real ``convert_moe_packed_tensors`` call on a whole
expert, bit for bit (the reference does it for one expert of every layer).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import parallel
from .errors import GkError

SCALES = 255  # E8M0 scale bytes with a value (255 is NaN)


def _convert(blocks: np.ndarray, scales: np.ndarray) -> torch.Tensor:
    """transformers' dequantization of rows [R, G, 16] / [R, G] -> [R, G*32] float32. Each row is
    passed as its own expert-sized prefix ([R, 1, G, 16]), so the function's final transpose of
    axes 1 and 2 moves a unit axis and is free."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = convert_moe_packed_tensors(torch.from_numpy(np.array(blocks))[:, None],
                                     torch.from_numpy(np.array(scales))[:, None], dtype=torch.float32)
    return out.reshape(blocks.shape[0], -1)


@functools.cache
def tables() -> tuple[np.ndarray, np.ndarray]:
    """(quad [65536, 4], factor [256]) float32, both computed by transformers' function."""
    pairs = np.arange(1 << 16, dtype="<u2").view(np.uint8).reshape(-1, 1, 16)  # 8 byte pairs a row
    quad = _convert(pairs, np.full(pairs.shape[:2], 127, np.uint8)).numpy().reshape(1 << 16, 4)
    ones = np.full((SCALES, 1, 16), 0x22, np.uint8)  # code 2 is 1.0 in both nibbles
    factor = np.full(256, np.nan, np.float32)
    factor[:SCALES] = _convert(ones, np.arange(SCALES, dtype=np.uint8)[:, None]).numpy()[:, 0]
    # every code at every scale: the product must be transformers' ldexp, bit for bit
    codes = np.tile((np.arange(16, dtype=np.uint8) * 0x11)[None, None], (SCALES, 1, 1))
    scales = np.arange(SCALES, dtype=np.uint8)[:, None]
    want = _convert(codes, scales).numpy()
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in both
        got = _decode(quad, factor, codes, scales)
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        raise GkError("the tabulated MXFP4 values differ from transformers' convert_moe_packed_tensors")
    quad.setflags(write=False)
    factor.setflags(write=False)
    return quad, factor


def _decode(quad: np.ndarray, factor: np.ndarray, blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    rows, groups = scales.shape
    v = np.take(quad, np.ascontiguousarray(blocks).view("<u2"), axis=0).reshape(rows, groups, 32)
    v *= factor[scales][..., None]
    return v.reshape(rows, groups * 32)


def dense(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Block rows [R, G, 16] u8 + scales [R, G] u8 -> [R, G*32] float32, as transformers decodes them."""
    quad, factor = tables()
    return _decode(quad, factor, blocks, scales)


def check_layout(blocks: np.ndarray, scales: np.ndarray, where: str) -> None:
    """One expert's projection [R, G, 16] through transformers' function as GPT-OSS loads it
    ([experts, R, G, 16] -> [experts, G*32, R]) against ``dense``: equal bit for bit, or an error."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    want = convert_moe_packed_tensors(torch.from_numpy(np.array(blocks))[None],
                                      torch.from_numpy(np.array(scales))[None], dtype=torch.float32)[0]
    if not torch.equal(want.T.contiguous().view(torch.int32), torch.from_numpy(dense(blocks, scales)).view(torch.int32)):
        raise GkError(f"{where}: the tabulated MXFP4 decode differs from transformers' convert_moe_packed_tensors")


def matmul_t(x: torch.Tensor, blocks: np.ndarray, scales: np.ndarray, rows: int = 128) -> torch.Tensor:
    """x [n, G*32] @ dense(blocks, scales).T -> [n, R], decoding ``rows`` block rows at a time so
    the dense weights never leave the cache (each output is the same dot product), the chunks on
    the host's cores."""
    R = scales.shape[0]
    out = torch.empty(x.shape[0], R, dtype=x.dtype, device=x.device)

    def chunk(r: int) -> None:
        w = torch.from_numpy(dense(blocks[r:r + rows], scales[r:r + rows])).to(x.device)
        out[:, r:r + rows] = x @ w.T

    parallel.each(chunk, range(0, R, rows))
    return out
