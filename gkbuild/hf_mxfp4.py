"""The reference's MXFP4 experts: transformers' own dequantization, made fast by tabulating it.

The reference must not decode MXFP4 with the build's code (``checkpoint.mxfp4``, ``kernels.mx``):
a bug there would then be in both and invisible to verify. GPT-OSS's published path is
``convert_moe_packed_tensors`` in transformers' ``integrations/mxfp4.py`` (5.24.0, lines 229-310):
a 16-entry e2m1 table (``FP4_VALUES``) indexed by the low nibble of each block byte into element
2j and by the high nibble into 2j+1, then ``torch.ldexp`` by ``scale - 127``, rows flattened and
the last two axes transposed. At 120b widths it costs ~0.3 s an expert here, and a 36-layer
golden uses ~20,000 expert matrices.

So this module calls that function once on inputs that enumerate its whole domain and keeps the
answers as a table: each output element depends only on its block byte's nibble and its block's
scale byte, so ``pairs[s << 8 | b]`` holds the two elements (low nibble first) transformers decodes
from byte ``b`` at scale ``s``, for all 256 bytes at each of the 255 scales with a value (255 is
NaN in E8M0 and refused when the checkpoint is read). ``dense`` decodes block rows with one lookup
of an 8-byte pair a block byte at ``scale << 8 | byte`` (``mxpairs.take``, the compiled lookup
the twins' readers share with their own table): no pass multiplies in the scale, and the lookup
releases the GIL, so ``matmul_t``'s chunks decode on both cores (issue 28: one 120b expert 3.0x
faster than 8379fb3's numpy take, 2.1x d3f86bc's, bench/bench_hf_mxfp4.py). The values are the
same whatever the lookup: the table holds transformers' own.
``check_layout`` compares ``dense`` with a real ``convert_moe_packed_tensors`` call on a whole
expert, bit for bit (the reference does it for one expert of every layer).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import mxpairs, parallel
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
def tables() -> np.ndarray:
    """pairs [65536, 2] float32, computed by transformers' function (rows of scale 255 are NaN)."""
    every = np.tile(np.arange(256, dtype=np.uint8).reshape(1, 16, 16), (SCALES, 1, 1))  # a scale's 256 bytes a row
    scales = np.repeat(np.arange(SCALES, dtype=np.uint8)[:, None], 16, axis=1)
    pairs = np.full((256, 256, 2), np.nan, np.float32)
    pairs[:SCALES] = _convert(every, scales).numpy().reshape(SCALES, 256, 2)
    pairs = pairs.reshape(1 << 16, 2)
    pairs.setflags(write=False)
    return pairs


def dense(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Block rows [R, G, 16] u8 + scales [R, G] u8 -> [R, G*32] float32, as transformers decodes them."""
    return mxpairs.take(tables(), blocks.view("<u2"), scales).reshape(scales.shape[0], -1)


def check_layout(blocks: np.ndarray, scales: np.ndarray, where: str) -> None:
    """One expert's projection [R, G, 16] through transformers' function as GPT-OSS loads it
    ([experts, R, G, 16] -> [experts, G*32, R]) against ``dense``: equal bit for bit, or an error."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    want = convert_moe_packed_tensors(torch.from_numpy(np.array(blocks))[None],
                                      torch.from_numpy(np.array(scales))[None], dtype=torch.float32)[0]
    if not torch.equal(want.T.contiguous().view(torch.int32), torch.from_numpy(dense(blocks, scales)).view(torch.int32)):
        raise GkError(f"{where}: the tabulated MXFP4 decode differs from transformers' convert_moe_packed_tensors")


def matmul_t(x: torch.Tensor, blocks: np.ndarray, scales: np.ndarray, rows: int = 256) -> torch.Tensor:
    """x [n, G*32] @ dense(blocks, scales).T -> [n, R], decoding ``rows`` block rows at a time so
    the dense weights stay near the core (at 120b widths 256 rows are 2.9 MB of float32), the chunks
    on the host's cores (or in this thread, if it is one of them). Each output is the same dot
    product whatever the chunk: goldens made with 32-, 128- and 256-row chunks are bit-identical.
    256, not 32: the Python between two GIL-free chunks made two threads slower than one at 32
    rows (12.1 ms an expert against 7.6; 5.1 ms at 256, issue 28)."""
    R = scales.shape[0]
    out = torch.empty(x.shape[0], R, dtype=x.dtype, device=x.device)

    def chunk(r: int) -> None:
        w = torch.from_numpy(dense(blocks[r:r + rows], scales[r:r + rows])).to(x.device)
        out[:, r:r + rows] = x @ w.T

    parallel.each(chunk, range(0, R, rows))
    return out
