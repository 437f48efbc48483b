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
    """One rank's KV cache: one allocation per group [2, num_blocks, kv, block, d] (K half, V half)."""

    layout: KvLayout
    buffers: list  # torch tensors

    def k(self, group: int):
        """The K half as the kernel takes it (packed FP8: [blocks, kv, block/2, d, 2], same bytes)."""
        k = self.buffers[group][0]
        return k.view(self.layout.k_packed_shape) if self.layout.packed else k

    def v(self, group: int):
        return self.buffers[group][1]


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
        return KvLayout(**{k: doc[k] for k in ("num_layers", "groups", "num_blocks", "kv_heads", "block_size",
                                                "head_dim", "dtype", "itemsize", "packed")})

    def allocate_kv(self, num_blocks: int | None = None) -> KvBuffers:
        """Zeroed KV buffers for one rank (optionally fewer blocks than the build's budget)."""
        import dataclasses

        import torch

        lay = self.kv_layout()
        if num_blocks is not None:
            lay = dataclasses.replace(lay, num_blocks=num_blocks)
        # Both FP8 formats are carried as torch.float8_e4m3fn: below the e4m3 max of 240 they share
        # every bit pattern, and values are clamped to the format's max before the cast.
        dt = torch.bfloat16 if lay.dtype == "bf16" else torch.float8_e4m3fn
        return KvBuffers(lay, [torch.zeros(lay.buffer_shape, dtype=dt) for _ in range(lay.groups)])

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
