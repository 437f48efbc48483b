"""The KV cache in either form the published GK decode takes: byte offsets, the DMA offset limit,
budget, and the disaggregated-inference (DI) metadata.

Two forms (``kv_cache.form``), both one ``K_cache`` and one ``V_cache`` tensor
``[entries, num_blocks, kv, block, d]`` (packed FP8 K ``[entries, num_blocks, kv, block/2, d, 2]``):

- ``stacked`` (aws-neuron/nki-library@e9ef98fc, and the fork F): entries = L. The kernel indexes
  entry ``i`` for layer ``i`` when the leading axis is ``num_layers`` (entry 0 when it is 1); with
  its KV write-back on, "caches MUST be stacked per-layer". Full and sliding layers of one sequence
  use the same block ids (their own entries), written through ONE update index.
- ``paired`` (F only: baonudesifeizhai/nki-library@9f2490f6, the HMA group layout): entries =
  ceil(L/2), layer ``i`` uses entry ``i // 2``, so sliding layer 2j and full layer 2j+1 share entry
  j. They draw block ids from one pool and must use DISJOINT blocks: sliding layers write through
  ``kv_cache_update_idx_swa``, full layers through ``kv_cache_update_idx``.

Either way a block's DMA offset spans the whole tensor: num_blocks is capped at
2^32 / (entries * block bytes): 14,563 stacked and 29,127 paired at 120b. Seed 000's runtime
allocates each layer pair as its own ``[2, num_blocks, kv, block, d]`` buffer (K half, V half);
no published kernel takes such buffers, so it survives here only as a description
(:func:`per_buffer_allocation`).

Packed FP8 K views a K ``[..., block, d]`` as ``[..., block//2, d, 2]``: the last axis holds two
consecutive tokens (0 = even, 1 = odd). V is never packed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import GkError

DMA_LIMIT = 1 << 32
FORMS = ("stacked", "paired")
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
    form: str  # stacked | paired
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
        """Leading-axis entries of K_cache and V_cache: one a layer (stacked), one a layer pair."""
        return entries(self.form, self.num_layers)

    def entry_of(self, layer: int) -> int:
        return layer if self.form == "stacked" else layer // 2

    @property
    def update_indices(self) -> tuple[str, ...]:
        """The update-index inputs: a pair's layers write disjoint blocks (paired)."""
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
        """One allocation: the K (or V) tensor [entries, nb, kv, block, d]."""
        return [self.entries] + self.block_shape

    @property
    def allocations(self) -> int:
        return 2

    @property
    def half_bytes(self) -> int:
        """One entry's K (or V) blocks."""
        return self.num_blocks * self.block_bytes

    @property
    def bytes_per_rank(self) -> int:
        return self.entries * 2 * self.half_bytes

    @property
    def dma_span_entries(self) -> int:
        """Entries one DMA base spans: the whole tensor."""
        return self.entries

    def max_num_blocks(self, form: str | None = None) -> int:
        """The uint32 DMA offset cap on num_blocks for a form (default: this one)."""
        return DMA_LIMIT // (entries(form or self.form, self.num_layers) * self.block_bytes)

    def k_offset(self, entry: int, block: int, head: int, token: int, channel: int) -> int:
        """Byte offset of K element (entry, block, head, token, channel) from the K tensor's base."""
        kv, bl, d, it = self.kv_heads, self.block_size, self.head_dim, self.itemsize
        base = entry * self.half_bytes
        if self.packed:
            return base + ((((block * kv + head) * (bl // 2) + token // 2) * d + channel) * 2 + token % 2) * it
        return base + (((block * kv + head) * bl + token) * d + channel) * it

    def v_offset(self, entry: int, block: int, head: int, token: int, channel: int) -> int:
        """Byte offset of V element from the V tensor's base."""
        kv, bl, d, it = self.kv_heads, self.block_size, self.head_dim, self.itemsize
        return entry * self.half_bytes + (((block * kv + head) * bl + token) * d + channel) * it

    def dma_check(self) -> dict:
        span = self.dma_span_entries * self.half_bytes
        return {
            "limit_bytes": DMA_LIMIT,
            "span_bytes": span,
            "fits": span <= DMA_LIMIT,
            "max_num_blocks": self.max_num_blocks(),
            "max_num_blocks_stacked": self.max_num_blocks("stacked"),
            "max_num_blocks_paired": self.max_num_blocks("paired"),
        }

    def layers(self) -> list[dict]:
        return [{"layer": i, "entry": self.entry_of(i), "block_table": table_of(i),
                 "update_index": "swa" if self.form == "paired" and table_of(i) == "swa" else "full"}
                for i in range(self.num_layers)]

    def di_regions(self) -> list[dict]:
        """NIXL registration: one region per entry of K and of V, each entry once (a paired
        entry's two layers share it); block b of a region sits at offset + b * block_len."""
        out = []
        for e in range(self.entries):
            shared = [i for i in range(self.num_layers) if self.entry_of(i) == e]
            for half, off in (("K", self.k_offset(e, 0, 0, 0, 0)), ("V", self.v_offset(e, 0, 0, 0, 0))):
                out.append({"entry": e, "half": half, "tensor": f"{half}_cache", "offset": off,
                            "block_len": self.block_bytes, "count": self.num_blocks, "layers": shared})
        return out

    def block_pool(self) -> dict:
        """How the layers of a sequence draw block ids (what a runtime and a DI peer must agree on)."""
        if self.form == "stacked":
            return {"pool": "one pool of num_blocks ids a rank",
                    "rule": "every layer has its own entry; a sequence's sliding and full layers use the SAME "
                            "block ids (the sliding table is the window's suffix of the full table), written "
                            "through one update index"}
        return {"pool": "one pool of num_blocks ids a rank, shared by an entry's two layers",
                "rule": "entry j holds layers 2j (sliding) and 2j+1 (full): their blocks come from one pool and "
                        "must be DISJOINT; each has its own block table and update index (sliding layers write "
                        "through kv_cache_update_idx_swa)"}

    def describe(self) -> dict:
        d = asdict(self)
        d.update(entries=self.entries, allocation_shape=self.allocation_shape, allocations=self.allocations,
                 k_shape=[self.entries] + self.k_block_shape, v_shape=[self.entries] + self.block_shape,
                 block_bytes=self.block_bytes, bytes_per_rank=self.bytes_per_rank, dma=self.dma_check(),
                 layers=self.layers(), di_regions=self.di_regions(), block_pool=self.block_pool(),
                 update_indices=list(self.update_indices), swa_di_truncation=SWA_DI_TRUNCATION,
                 offsets={"k": "entry*num_blocks*block_bytes + "
                          + ("((((b*kv + h)*(block/2) + t/2)*d + c)*2 + t%2)*itemsize" if self.packed
                             else "(((b*kv + h)*block + t)*d + c)*itemsize"),
                          "v": "entry*num_blocks*block_bytes + (((b*kv + h)*block + t)*d + c)*itemsize"})
        if self.form == "paired":
            d["per_buffer_allocation"] = per_buffer_allocation(self)
        return d


def entries(form: str, num_layers: int) -> int:
    """K_cache / V_cache leading entries of a form: L (stacked), ceil(L/2) (paired)."""
    return num_layers if form == "stacked" else -(-num_layers // 2)


def per_buffer_allocation(kv: KvLayout) -> dict:
    """Seed 000's runtime view of the paired form: the same layer pairs, each its own buffer. A
    description for runtimes and DI peers that allocate that way; no published kernel takes it."""
    return {"buffers": kv.entries, "buffer_shape": [2] + kv.block_shape,
            "note": "seed 000 allocates layer pair j (layers 2j, 2j+1) as one [2, num_blocks, kv, block, d] buffer "
                    "(K half, V half); the published paired kernel takes entry j of K_cache and of V_cache "
                    "instead: same block ids and pool rule, different addresses, so such a runtime copies or "
                    "registers per entry, not per buffer"}


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
