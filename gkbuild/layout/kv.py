"""The KV cache: per-group buffers, the packed FP8 K view, byte offsets, budget and DI regions.

vLLM's hybrid KV manager puts GPT-OSS's 36 layers into 18 shared buffers: buffer j holds layers 2j
(sliding) and 2j+1 (full); the kernel picks the buffer by i // 2 and the block table and write index
by i % 2. Each buffer is its own allocation [2, num_blocks, kv, block, d] (K half, V half), indexed
base-0, so a block's DMA offset stays within one buffer. Packed FP8 K views the K half as
[num_blocks, kv, block//2, d, 2]: the last axis holds two consecutive tokens (0 = even, 1 = odd).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import GkError

DMA_LIMIT = 1 << 32


def buffer_of(layer: int) -> int:
    return layer // 2


def table_of(layer: int) -> str:
    """Even layers slide (trimmed block table, window-frame positions); odd ones are full."""
    return "swa" if layer % 2 == 0 else "full"


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    groups: int
    num_blocks: int
    kv_heads: int  # per rank
    block_size: int
    head_dim: int
    dtype: str
    itemsize: int
    packed: bool

    @property
    def block_bytes(self) -> int:
        """One block of one half (K or V) of one buffer: the DI block_len."""
        return self.kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def buffer_shape(self) -> list[int]:
        return [2, self.num_blocks, self.kv_heads, self.block_size, self.head_dim]

    @property
    def k_packed_shape(self) -> list[int]:
        return [self.num_blocks, self.kv_heads, self.block_size // 2, self.head_dim, 2]

    @property
    def half_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def bytes_per_rank(self) -> int:
        return self.groups * 2 * self.half_bytes

    def k_offset(self, block: int, head: int, token: int, channel: int) -> int:
        """Byte offset of K element (block, head, token, channel) from its buffer's base."""
        kv, bl, d, it = self.kv_heads, self.block_size, self.head_dim, self.itemsize
        if self.packed:
            return ((((block * kv + head) * (bl // 2) + token // 2) * d + channel) * 2 + token % 2) * it
        return (((block * kv + head) * bl + token) * d + channel) * it

    def v_offset(self, block: int, head: int, token: int, channel: int) -> int:
        kv, bl, d, it = self.kv_heads, self.block_size, self.head_dim, self.itemsize
        return self.half_bytes + (((block * kv + head) * bl + token) * d + channel) * it

    def dma_check(self) -> dict:
        """Per-buffer K/V args are base-0: each half must span under 2^32 bytes."""
        return {
            "limit_bytes": DMA_LIMIT,
            "half_span_bytes": self.half_bytes,
            "fits": self.half_bytes <= DMA_LIMIT,
            "max_num_blocks_per_buffer": DMA_LIMIT // self.block_bytes,
            "max_num_blocks_single_stacked_tensor": DMA_LIMIT // (self.num_layers * self.block_bytes),
        }

    def layers(self) -> list[dict]:
        return [{"layer": i, "buffer": buffer_of(i), "block_table": table_of(i)} for i in range(self.num_layers)]

    def di_regions(self) -> list[dict]:
        """NIXL registration: one region per buffer half, each buffer once (its layers share it)."""
        out = []
        for j in range(self.groups):
            shared = [i for i in range(self.num_layers) if buffer_of(i) == j]
            for half, base in (("K", 0), ("V", self.half_bytes)):
                out.append({"buffer": j, "half": half, "offset": base, "block_len": self.block_bytes,
                            "count": self.num_blocks, "layers": shared})
        return out

    def describe(self) -> dict:
        d = asdict(self)
        d.update(buffer_shape=self.buffer_shape, k_packed_shape=self.k_packed_shape if self.packed else None,
                 block_bytes=self.block_bytes, bytes_per_rank=self.bytes_per_rank, dma=self.dma_check(),
                 layers=self.layers(), di_regions=self.di_regions(),
                 offsets={"k": "((((b*kv + h)*(block/2) + t/2)*d + c)*2 + t%2)*itemsize" if self.packed
                          else "(((b*kv + h)*block + t)*d + c)*itemsize",
                          "v": "num_blocks*kv*block*d*itemsize + (((b*kv + h)*block + t)*d + c)*itemsize"})
        return d


def groups_for(num_layers: int) -> int:
    return -(-num_layers // 2)


def budget_blocks(layout_per_block_bytes: int, hbm_bytes: float, weight_bytes: int, where: str) -> int:
    """num_blocks that fit in HBM after the weights (no cap: the DMA check is separate)."""
    free = int(hbm_bytes) - weight_bytes
    n = free // layout_per_block_bytes if free > 0 else 0
    if n < 1:
        raise GkError(f"{where}: kv_cache: the KV budget does not fit: {weight_bytes / 2**30:.2f} GiB of weights "
                      f"per rank leave {max(free, 0) / 2**30:.2f} GiB of {hbm_bytes / 2**30:.2f} GiB usable, "
                      f"less than one block per buffer ({layout_per_block_bytes} bytes)")
    return n


# -- writing and reading one token's K/V in the paged buffers ------------------------------------
def pack_block(k):
    """K [..., block, d] -> packed [..., block//2, d, 2] (numpy or torch; a view where possible)."""
    *lead, bl, d = k.shape
    return k.reshape(*lead, bl // 2, 2, d).swapaxes(-1, -2)


def unpack_block(p):
    """Packed K [..., block//2, d, 2] -> [..., block, d]."""
    *lead, half, d, _ = p.shape
    return p.swapaxes(-1, -2).reshape(*lead, half * 2, d)


def write_k(k_half, block, token, k, packed: bool) -> None:
    """Store K [..., kv, d] of tokens at (block, token) of a buffer's K half, in place. ``block``
    and ``token`` are ints or index arrays of one shape (numpy or torch)."""
    if packed:
        k_half[block, :, token // 2, :, token % 2] = k
    else:
        k_half[block, :, token, :] = k


def read_k(k_half, block, token, packed: bool):
    """K [..., kv, d] of tokens at (block, token); the inverse of :func:`write_k`."""
    return k_half[block, :, token // 2, :, token % 2] if packed else k_half[block, :, token, :]
