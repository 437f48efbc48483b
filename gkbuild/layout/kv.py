"""The KV cache in either form the GK decode takes: byte offsets, the DMA offset limit, budget,
and the disaggregated-inference (DI) metadata.

Two forms (``kv_cache.form``):

- ``stacked`` (the public nki-library ``gpt_oss_decode_mega_kernel``): one ``K_cache`` and one
  ``V_cache`` tensor, each ``[L, num_blocks, kv, block, d]`` (packed FP8 K
  ``[L, num_blocks, kv, block/2, d, 2]``). The kernel indexes entry ``i`` for layer ``i`` when the
  leading axis is ``num_layers`` and entry 0 for every layer otherwise; with its KV write-back
  on, "caches MUST be stacked per-layer". So entries = L, and full and sliding layers of one
  sequence use the same block ids (their own entries), written through ONE update index. The
  block's DMA offset spans the whole tensor: num_blocks is capped at 2^32 / (L * block bytes).
- ``per_buffer`` (the GK integration of seed 000, a fork not yet public): vLLM's hybrid manager
  puts the L layers into ceil(L/2) buffers; buffer j holds layers 2j (sliding) and 2j+1 (full),
  each its own allocation ``[2, num_blocks, kv, block, d]`` (K half, V half) indexed base-0, so
  the offset spans one buffer half. A buffer's two layers draw block ids from one pool, so they
  must use disjoint blocks, written through two update indices (full, sliding).

Packed FP8 K views a K ``[..., block, d]`` as ``[..., block//2, d, 2]``: the last axis holds two
consecutive tokens (0 = even, 1 = odd). V is never packed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import GkError

DMA_LIMIT = 1 << 32
FORMS = ("stacked", "per_buffer")
# vLLM's N-1 rule for sliding-window layers under disaggregated inference (seed 000): the decode
# node admits a prompt of length N but recomputes its last token at N-1, so both nodes operate at
# N-1, or the window's oldest block is evicted one step early and never transferred.
SWA_DI_TRUNCATION = ("prefill and decode both operate at N-1 for a prompt of N tokens, so the sliding "
                     "window never evicts a block the transfer still needs (at N % block == block - 1)")


def table_of(layer: int) -> str:
    """Even layers slide (trimmed block table, window-frame positions); odd ones are full."""
    return "swa" if layer % 2 == 0 else "full"


@dataclass(frozen=True)
class KvLayout:
    form: str  # stacked | per_buffer
    num_layers: int
    num_blocks: int
    kv_heads: int  # per rank
    block_size: int
    head_dim: int
    dtype: str
    itemsize: int
    packed: bool

    @property
    def entries(self) -> int:
        """Leading-axis entries of the KV storage: one a layer (stacked), one a layer pair."""
        return self.num_layers if self.form == "stacked" else -(-self.num_layers // 2)

    def entry_of(self, layer: int) -> int:
        return layer if self.form == "stacked" else layer // 2

    @property
    def update_indices(self) -> tuple[str, ...]:
        """The update-index inputs: per_buffer layers of a pair write disjoint blocks."""
        return ("full",) if self.form == "stacked" else ("full", "swa")

    @property
    def block_bytes(self) -> int:
        """One block of one entry's K (or V): the DI block_len."""
        return self.kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def block_shape(self) -> list[int]:
        return [self.num_blocks, self.kv_heads, self.block_size, self.head_dim]

    @property
    def k_block_shape(self) -> list[int]:
        """K of one entry as the kernel takes it (packed: [nb, kv, block/2, d, 2])."""
        if self.packed:
            return [self.num_blocks, self.kv_heads, self.block_size // 2, self.head_dim, 2]
        return self.block_shape

    @property
    def allocation_shape(self) -> list[int]:
        """One allocation: the stacked K (or V) tensor, or one per-buffer [2, nb, kv, block, d]."""
        if self.form == "stacked":
            return [self.entries] + self.block_shape
        return [2] + self.block_shape

    @property
    def allocations(self) -> int:
        return 2 if self.form == "stacked" else self.entries

    @property
    def half_bytes(self) -> int:
        """One entry's K (or V) blocks."""
        return self.num_blocks * self.block_bytes

    @property
    def bytes_per_rank(self) -> int:
        return self.entries * 2 * self.half_bytes

    @property
    def dma_span_entries(self) -> int:
        """Entries one DMA base spans: the whole stacked tensor, or one buffer half."""
        return self.entries if self.form == "stacked" else 1

    def max_num_blocks(self, form: str | None = None) -> int:
        """The uint32 DMA offset cap on num_blocks for a form (default: this one)."""
        span = self.num_layers if (form or self.form) == "stacked" else 1
        return DMA_LIMIT // (span * self.block_bytes)

    def k_offset(self, entry: int, block: int, head: int, token: int, channel: int) -> int:
        """Byte offset of K element (entry, block, head, token, channel) from the K base (the
        stacked K tensor, or the entry's buffer)."""
        kv, bl, d, it = self.kv_heads, self.block_size, self.head_dim, self.itemsize
        base = entry * self.half_bytes if self.form == "stacked" else 0
        if self.packed:
            return base + ((((block * kv + head) * (bl // 2) + token // 2) * d + channel) * 2 + token % 2) * it
        return base + (((block * kv + head) * bl + token) * d + channel) * it

    def v_offset(self, entry: int, block: int, head: int, token: int, channel: int) -> int:
        """Byte offset of V element from the V base (the stacked V tensor, or the entry's buffer:
        its V half follows the K half)."""
        kv, bl, d, it = self.kv_heads, self.block_size, self.head_dim, self.itemsize
        base = entry * self.half_bytes if self.form == "stacked" else self.half_bytes
        return base + (((block * kv + head) * bl + token) * d + channel) * it

    def dma_check(self) -> dict:
        span = self.dma_span_entries * self.half_bytes
        return {
            "limit_bytes": DMA_LIMIT,
            "span_bytes": span,
            "fits": span <= DMA_LIMIT,
            "max_num_blocks": self.max_num_blocks(),
            "max_num_blocks_stacked": self.max_num_blocks("stacked"),
            "max_num_blocks_per_buffer": self.max_num_blocks("per_buffer"),
        }

    def layers(self) -> list[dict]:
        return [{"layer": i, "entry": self.entry_of(i), "block_table": table_of(i),
                 "update_index": "swa" if self.form == "per_buffer" and table_of(i) == "swa" else "full"}
                for i in range(self.num_layers)]

    def di_regions(self) -> list[dict]:
        """NIXL registration: one region per entry's K and V, each entry once (a per-buffer
        entry's two layers share it); block b of a region sits at offset + b * block_len."""
        out = []
        for e in range(self.entries):
            shared = [i for i in range(self.num_layers) if self.entry_of(i) == e]
            for half, off in (("K", self.k_offset(e, 0, 0, 0, 0)), ("V", self.v_offset(e, 0, 0, 0, 0))):
                out.append({"entry": e, "half": half, "tensor": half if self.form == "stacked" else f"buffer {e}",
                            "offset": off, "block_len": self.block_bytes, "count": self.num_blocks,
                            "layers": shared})
        return out

    def block_pool(self) -> dict:
        """How the layers of a sequence draw block ids (what a runtime and a DI peer must agree on)."""
        if self.form == "stacked":
            return {"pool": "one pool of num_blocks ids a rank",
                    "rule": "every layer has its own entry; a sequence's sliding and full layers use the SAME "
                            "block ids (the sliding table is the window's suffix of the full table), written "
                            "through one update index"}
        return {"pool": "one pool of num_blocks ids a rank, shared by a buffer's two layers",
                "rule": "buffer j holds layers 2j (sliding) and 2j+1 (full): their blocks come from one pool and "
                        "must be DISJOINT; each has its own block table and update index"}

    def describe(self) -> dict:
        d = asdict(self)
        d.update(entries=self.entries, allocation_shape=self.allocation_shape, allocations=self.allocations,
                 k_shape=([self.entries] if self.form == "stacked" else []) + self.k_block_shape,
                 v_shape=([self.entries] if self.form == "stacked" else []) + self.block_shape,
                 block_bytes=self.block_bytes, bytes_per_rank=self.bytes_per_rank, dma=self.dma_check(),
                 layers=self.layers(), di_regions=self.di_regions(), block_pool=self.block_pool(),
                 update_indices=list(self.update_indices), swa_di_truncation=SWA_DI_TRUNCATION,
                 offsets={"k": ("entry*num_blocks*block_bytes + " if self.form == "stacked" else "")
                          + ("((((b*kv + h)*(block/2) + t/2)*d + c)*2 + t%2)*itemsize" if self.packed
                             else "(((b*kv + h)*block + t)*d + c)*itemsize"),
                          "v": ("entry*num_blocks*block_bytes" if self.form == "stacked"
                                else "num_blocks*block_bytes") + " + (((b*kv + h)*block + t)*d + c)*itemsize"})
        return d


def budget_blocks(layout_per_block_bytes: int, usable_bytes: int, weight_bytes: int, reserve_bytes: int,
                  where: str) -> int:
    """num_blocks that fit in the usable device bytes after the device weights (the DMA cap is applied by
    the caller). ``usable_bytes`` already leaves room for the reserve."""
    free = usable_bytes - weight_bytes
    n = free // layout_per_block_bytes if free > 0 else 0
    if n < 1:
        raise GkError(f"{where}: kv_cache: the KV budget does not fit: {weight_bytes / 2**30:.2f} GiB of device "
                      f"weights per rank leave {max(free, 0) / 2**30:.2f} GiB of {max(usable_bytes, 0) / 2**30:.2f} "
                      f"GiB usable (memory_utilization, and a {reserve_bytes / 2**30:.2f} GiB device reserve), "
                      f"less than one block per entry ({layout_per_block_bytes} bytes)")
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


def write_k(k_entry, block, token, k, packed: bool) -> None:
    """Store K [..., kv, d] of tokens at (block, token) of one entry's K, in place. ``block``
    and ``token`` are ints or index arrays of one shape (numpy or torch)."""
    if packed:
        k_entry[block, :, token // 2, :, token % 2] = k
    else:
        k_entry[block, :, token, :] = k


def read_k(k_entry, block, token, packed: bool):
    """K [..., kv, d] of tokens at (block, token); the inverse of :func:`write_k`."""
    return k_entry[block, :, token // 2, :, token % 2] if packed else k_entry[block, :, token, :]
