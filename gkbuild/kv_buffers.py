"""One rank's KV cache as tensors, in the build's form: what a runtime allocates and hands the
decode program, and what a compiled program receives back as its K/V arguments. Apart from
``runtime`` so that the compiled programs (``compile.programs``) can rebuild it without importing
the runtime that loads them."""

from __future__ import annotations

from dataclasses import dataclass

from .layout.kv import KvLayout


@dataclass
class KvBuffers:
    """One rank's KV cache in the build's form (``layout.form``).

    ``allocations`` are the tensors a runtime hands the device: the K and the V tensor
    ``[entries, num_blocks, kv, block, d]`` (entries = L stacked, ceil(L/2) paired).
    ``k(layer)`` / ``v(layer)`` are that layer's entry as the kernel reads it (packed FP8 K:
    ``[num_blocks, kv, block/2, d, 2]``, the same bytes). Both FP8 formats are held as
    float8_e4m3fn: trn2's IEEE-style e4m3 (max 240) has the same bit patterns for every value
    within +-240, and the build only ever stores values saturated there (Neuron's documented route,
    ``--experimental-unsafe-fp8e4m3fn-as-fp8e4m3``); ``dtype`` names the format the bytes are in.
    """

    layout: KvLayout
    allocations: list  # torch tensors: K, V

    @property
    def dtype(self) -> str:
        return self.layout.dtype

    def _k_all(self):
        k, lay = self.allocations[0], self.layout
        return k.view([lay.entries] + lay.k_block_shape) if lay.packed and k.dim() == 5 else k

    def k(self, layer: int):
        """Layer ``layer``'s K entry as the kernel takes it (packed FP8: [nb, kv, block/2, d, 2])."""
        return self._k_all()[self.layout.entry_of(layer)]

    def v(self, layer: int):
        return self.allocations[1][self.layout.entry_of(layer)]

    def arguments(self) -> dict:
        """The decode kernel's KV arguments by name (views of the allocations)."""
        return {"K_cache": self._k_all(), "V_cache": self.allocations[1]}

    @classmethod
    def from_arguments(cls, layout: KvLayout, args: dict) -> "KvBuffers":
        """The inverse of :meth:`arguments`: buffers over tensors given as kernel arguments
        (what a compiled program receives)."""
        return cls(layout, [args["K_cache"], args["V_cache"]])
