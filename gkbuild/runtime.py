"""What a runtime calls: open a build by its manifest, load one rank's tensors zero-copy, allocate
that rank's KV buffers.

``Build.open`` refuses a manifest it cannot honour before any byte of a shard is touched: an
unknown schema version, another target, a world size the caller does not have. ``load_rank``
maps the rank's shard files copy-on-write and returns torch tensors that share those pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import dtypes
from .pipeline import manifest as mf
from .checkpoint.safetensors_io import MappedFile, read_header
from .errors import GkError
from .layout.kv import KvLayout


@dataclass
class KvBuffers:
    """One rank's KV cache in the build's form (``layout.form``).

    ``allocations`` are the tensors a runtime hands the device: stacked, the K and the V tensor
    ``[L, num_blocks, kv, block, d]``; per-buffer, one ``[2, num_blocks, kv, block, d]`` a layer pair.
    ``k(layer)`` / ``v(layer)`` are that layer's entry as the kernel reads it (packed FP8 K:
    ``[num_blocks, kv, block/2, d, 2]``, the same bytes). trn2's float8_e4m3 (max 240) is held as
    raw bytes and viewed as float8_e4m3fn, whose bit patterns are the same within +-240 (torch has
    no IEEE-style e4m3); ``dtype`` names the format the bytes are in.
    """

    layout: KvLayout
    allocations: list  # torch tensors

    @property
    def dtype(self) -> str:
        return self.layout.dtype

    def _carrier(self, t):
        import torch

        return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t

    def _k_entry(self, e: int):
        lay = self.layout
        k = self.allocations[0][e] if lay.form == "stacked" else self.allocations[e][0]
        return self._carrier(k.view(lay.k_block_shape) if lay.packed else k)

    def _v_entry(self, e: int):
        lay = self.layout
        return self._carrier(self.allocations[1][e] if lay.form == "stacked" else self.allocations[e][1])

    def k(self, layer: int):
        """Layer ``layer``'s K entry as the kernel takes it (packed FP8: [nb, kv, block/2, d, 2])."""
        return self._k_entry(self.layout.entry_of(layer))

    def v(self, layer: int):
        return self._v_entry(self.layout.entry_of(layer))

    def arguments(self) -> dict:
        """The decode kernel's KV arguments by name (views of the allocations)."""
        lay = self.layout
        if lay.form == "stacked":
            k = self.allocations[0]
            k = k.view([lay.entries] + lay.k_block_shape) if lay.packed else k
            return {"K_cache": self._carrier(k), "V_cache": self._carrier(self.allocations[1])}
        out = {f"K_cache_buf_{j}": self._k_entry(j) for j in range(lay.entries)}
        out.update({f"V_cache_buf_{j}": self._v_entry(j) for j in range(lay.entries)})
        return out

    @classmethod
    def from_arguments(cls, layout: KvLayout, args: dict) -> "KvBuffers":
        """The inverse of :meth:`arguments`: buffers over tensors given as kernel arguments
        (what a compiled program receives)."""
        if layout.form == "stacked":
            return _KvArgs(layout, [args["K_cache"]], [args["V_cache"]])
        return _KvArgs(layout, [args[f"K_cache_buf_{j}"] for j in range(layout.entries)],
                       [args[f"V_cache_buf_{j}"] for j in range(layout.entries)])


class _KvArgs(KvBuffers):
    """KV buffers seen through the kernel's arguments (entries already in the kernel's view)."""

    def __init__(self, layout: KvLayout, k: list, v: list):
        super().__init__(layout, k + v)
        self._k, self._v = k, v

    def _k_entry(self, e: int):
        return self._k[0][e] if self.layout.form == "stacked" else self._k[e]

    def _v_entry(self, e: int):
        return self._v[0][e] if self.layout.form == "stacked" else self._v[e]


class Build:
    def __init__(self, root: Path, manifest: dict):
        self.root = root
        self.manifest = manifest
        self._files = {f["path"]: f for f in manifest["files"]}
        self._maps: dict[str, MappedFile] = {}

    @classmethod
    def open(cls, path: Path | str, target: str | None = None, world_size: int | None = None) -> "Build":
        root = Path(path)
        m = mf.load(root)
        if target is not None and m["target"] != target:
            raise GkError(f"{root}: built for target {m['target']!r}, not {target!r}")
        world = m["topology"]["world_size"]
        if world_size is not None and world_size != world:
            raise GkError(f"{root}: built for {world} ranks (TP{m['topology']['tp']} x DP{m['topology']['dp']}), "
                          f"this runtime has {world_size}")
        return cls(root, m)

    @property
    def world_size(self) -> int:
        return self.manifest["topology"]["world_size"]

    def rank_info(self, rank: int) -> dict:
        if not 0 <= rank < self.world_size:
            raise GkError(f"{self.root}: rank {rank} is outside 0..{self.world_size - 1}")
        return self.manifest["ranks"][rank]

    def _mapped(self, rel: str) -> MappedFile:
        if rel not in self._maps:
            entry = self._files.get(rel)
            if entry is None:
                raise GkError(f"{self.root}: {rel} is not in the manifest")
            p = self.root / rel
            if not p.is_file():
                raise GkError(f"{p}: missing (listed in the manifest)")
            if p.stat().st_size != entry["size"]:
                raise GkError(f"{p}: {p.stat().st_size} bytes, the manifest says {entry['size']}")
            header = read_header(p)
            for t in entry.get("tensors", []):
                info = header.tensors.get(t["name"])
                if info is None or list(info.shape) != t["shape"] or info.dtype.name != t["dtype"]:
                    raise GkError(f"{p}: tensor {t['name']} does not match the manifest")
            self._maps[rel] = MappedFile(header, private=True)
        return self._maps[rel]

    def load_rank(self, rank: int) -> dict:
        """{argument name: torch tensor} for one rank, sharing the mapped file pages."""
        import torch

        out = {}
        for load in self.rank_info(rank)["loads"]:
            mapped = self._mapped(load["file"])
            for name in load["tensors"]:
                info = mapped.header.tensors[name]
                arr = mapped.array(info)
                dt = dtypes.dtype(info.dtype.name)
                if dt.name == "bf16":
                    t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
                elif dt.name == "u16":
                    t = torch.from_numpy(arr.view(np.int16)).view(torch.uint16)
                else:
                    t = torch.from_numpy(arr)
                out[name] = t
        return out

    def program(self, name: str):
        """A compiled program (``decode`` or ``tail``) of a cpu/cuda build, loaded only after its
        bytes, target and torch version are checked against the manifest (it is native code)."""
        import torch

        from .pipeline.fingerprint import sha256_file

        art = next((a for a in self.manifest["compile"]["artifacts"] if a["name"] == name), None)
        if art is None or art["path"] is None:
            raise GkError(f"{self.root}: no compiled {name} program ({self.manifest['compile']['status']})")
        if art["format"] != "aoti-pt2":
            raise GkError(f"{self.root}: the {name} program is a {art['format']}; it runs on {art['target']}, not here")
        p = self.root / art["path"]
        if not p.is_file():
            raise GkError(f"{p}: missing (listed in the manifest)")
        digest = sha256_file(p)
        if digest != art["sha256"]:
            raise GkError(f"{p}: refused: sha256 {digest[:16]}... is not the manifest's {art['sha256'][:16]}... "
                          f"(the file changed since it was built)")
        if art["compiler"]["version"] != torch.__version__:
            raise GkError(f"{p}: refused: compiled by torch {art['compiler']['version']}, this is torch "
                          f"{torch.__version__}")
        if art["target"] == "cuda" and not torch.cuda.is_available():
            raise GkError(f"{p}: refused: built for cuda, and no GPU is available here")
        return torch._inductor.aoti_load_package(str(p))

    def kv_layout(self) -> KvLayout:
        kv = self.manifest["layout"]["kv"]
        doc = _read_json(self.root / kv["file"])
        return KvLayout(**{k: doc[k] for k in ("form", "num_layers", "num_blocks", "kv_heads", "block_size",
                                                "head_dim", "dtype", "itemsize", "packed")})

    def allocate_kv(self, num_blocks: int | None = None) -> KvBuffers:
        """Zeroed KV buffers for one rank in the build's form (optionally fewer blocks than the
        build's budget)."""
        import dataclasses

        import torch

        lay = self.kv_layout()
        if num_blocks is not None:
            lay = dataclasses.replace(lay, num_blocks=num_blocks)
        dt = {"bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3": torch.uint8}[lay.dtype]
        return KvBuffers(lay, [torch.zeros(lay.allocation_shape, dtype=dt) for _ in range(lay.allocations)])

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


def _read_json(p: Path) -> dict:
    import json

    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise GkError(f"{p}: missing (listed in the manifest)") from None
