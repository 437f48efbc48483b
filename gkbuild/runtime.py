"""What a runtime calls: open a build by its manifest, load one rank's device tensors (and the
host-side ones the runtime itself uses) zero-copy, allocate that rank's KV buffers.

``Build.open`` refuses a manifest it cannot honour before any byte of a shard is touched: an
unknown schema version, another target, a world size the caller does not have, another build than
``expect_build_id``, a path that leaves the folder. Every file the runtime reads (shards, the KV
and tail layout, programs) is checked against the manifest when first read: ``verify="hash"``
(the default) hashes it, unless this host already hashed the very same file (same real path,
size, mtime and inode; remembered in ``$GKBUILD_CACHE/fingerprints.json``); ``"size"`` checks
sizes only; ``"none"`` trusts the folder. ``load_rank`` maps the rank's shard files
copy-on-write and returns torch tensors that share those pages.

With ``trust``, the signature vouches for the manifest; the verify mode says what reaches the
files: ``"hash"``: every file read is the signed bytes; ``"size"``: only that each has the signed
size (a shard edited in place at the same size loads); ``"none"``: nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np

from . import dtypes, jsonio
from .pipeline import manifest as mf
from .checkpoint.safetensors_io import MappedFile, read_header
from .errors import GkError
from .layout import validate
from .kv_buffers import KvBuffers
from .layout.kv import KvLayout
from .paths import confined, inside

VERIFY = ("hash", "size", "none")


def _confine(root: Path, m: dict) -> None:
    """Refuse a manifest that names a path leaving the build."""
    where = f"{root / mf.NAME}"
    for rel in [f["path"] for f in m["files"]] + [x["file"] for r in m["ranks"] for x in r["loads"]] + \
            [m["layout"][k]["file"] for k in ("kv", "tail")] + \
            [a["path"] for a in m["compile"]["artifacts"] if a.get("path") is not None]:
        confined(rel, where)


class Build:
    def __init__(self, root: Path, manifest: dict, verify: str = "hash", digest: str | None = None, opener=None):
        """``opener``: where the files' bytes come from when not from the folder ``root``: its
        ``path(rel)`` is a path to the file's bytes, checked against the manifest
        (``publish.shards.StoreFiles``: a store's blobs, hashed as they are read)."""
        self.root = root
        self._opener = opener
        self.manifest = manifest
        self.verify = verify
        self.digest = digest or hashlib.sha256(mf.canonical(manifest)).hexdigest()  # what a remembered hash vouches for
        self._files = {f["path"]: f for f in manifest["files"]}
        self._maps: dict[str, MappedFile] = {}
        self._checked: dict[str, Path] = {}  # files checked: where their bytes are
        self.signature = None  # who signed the manifest (``signing.Verified``), when opened with ``trust``
        self._layouts: dict[str, dict] = {}

    @classmethod
    def open(cls, path: Path | str, target: str | None = None, world_size: int | None = None,
             verify: str = "hash", expect_build_id: str | None = None, trust: list | None = None) -> "Build":
        """``trust``: public key files and keyless identities (``gkbuild.publish.signing.trust_list``),
        one of which must have signed this manifest (its ``manifest.sig``), else the build is refused
        before anything else is read (``signature`` then says who signed it). A signature covers the
        manifest; ``verify`` decides how far that reaches the files read: ``"hash"`` (the default)
        refuses any file that is not the signed bytes, ``"size"`` only one of another size (a file
        edited at the same size loads: use it only where the folder cannot be written), ``"none"``
        checks nothing. ``verify_files`` checks every file at once."""
        root = Path(path)
        if verify not in VERIFY:
            raise GkError(f"verify={verify!r}: expected one of {', '.join(VERIFY)}")
        man_bytes = mf.read_bytes(root)
        m = mf.parse(man_bytes, str(root / mf.NAME))
        signed = None
        if trust is not None:
            from .publish import signing

            signed = signing.verify(man_bytes, signing.read_folder(root), signing.trust_list(trust),
                                    f"{root} (build {m['name']} {m['build_id'][:16]})")
        if expect_build_id is not None:
            want = str(expect_build_id).lower()
            if len(want) < 12 or not m["build_id"].startswith(want):
                raise GkError(f"{root}: holds build {m['build_id'][:16]}, not the expected {want[:64]} "
                              f"(give at least 12 hex digits)")
        if target is not None and m["target"] != target:
            raise GkError(f"{root}: built for target {m['target']!r}, not {target!r}")
        world = m["topology"]["world_size"]
        if world_size is not None and world_size != world:
            raise GkError(f"{root}: built for {world} ranks (TP{m['topology']['tp']} x DP{m['topology']['dp']}), "
                          f"this runtime has {world_size}")
        build = cls.made(root, m, man_bytes, verify)
        build.signature = signed
        return build

    @classmethod
    def made(cls, root: Path, m: dict, man_bytes: bytes, verify: str, opener=None) -> "Build":
        """A build of the parsed manifest ``m``: every path it names confined, its KV and tail
        layouts read and held to it."""
        _confine(root, m)
        build = cls(root, m, verify, hashlib.sha256(man_bytes).hexdigest(), opener)
        build._kv = validate.kv(build.layout_doc("kv"), m, root)
        validate.tail(build.layout_doc("tail"), m, root)
        return build

    @property
    def world_size(self) -> int:
        return self.manifest["topology"]["world_size"]

    def rank_info(self, rank: int) -> dict:
        if not 0 <= rank < self.world_size:
            raise GkError(f"{self.root}: rank {rank} is outside 0..{self.world_size - 1}")
        return self.manifest["ranks"][rank]

    def verify_files(self, advance=lambda n: None) -> int:
        """Check every file the manifest lists as ``verify`` says (``gkbuild verify-signature``: the
        files against the signed manifest); how many. ``advance(nbytes)`` counts what is hashed."""
        for f in self.manifest["files"]:
            self.file(f["path"], advance)
        return len(self.manifest["files"])

    def file(self, rel: str, advance=lambda n: None) -> Path:
        """The path of a file the manifest lists, checked as ``verify`` says (once per Build)."""
        entry = self._files.get(rel)
        if entry is None:
            raise GkError(f"{self.root}: {rel} is not in the manifest")
        if self._opener is not None:
            if rel not in self._checked:
                self._checked[rel] = self._opener.path(rel)
            return self._checked[rel]
        p = inside(self.root, rel)
        if rel in self._checked or self.verify == "none":
            return p
        if not p.is_file():
            raise GkError(f"{p}: missing (listed in the manifest)")
        if p.stat().st_size != entry["size"]:
            raise GkError(f"{p}: {p.stat().st_size} bytes, the manifest says {entry['size']}")
        if self.verify == "hash":
            from .checkpoint.source import cache_root
            from .pipeline.fingerprint import Fingerprints, sha256_file

            fps = Fingerprints(cache_root())
            digest = fps.lookup(p, scope=self.digest)
            if digest is None:
                digest = sha256_file(p, advance)
                fps.remember(p, digest, scope=self.digest)
                with contextlib.suppress(OSError):  # a read-only cache: the file is simply hashed again next time
                    fps.save()
            if digest != entry["sha256"]:
                raise GkError(f"{p}: refused: sha256 {digest[:16]}... is not the manifest's {entry['sha256'][:16]}... "
                              f"(the file changed since it was built; run gkbuild check)")
        self._checked[rel] = p
        return p

    def _mapped(self, rel: str) -> MappedFile:
        if rel not in self._maps:
            entry = self._files.get(rel)
            p = self.file(rel)
            header = read_header(p)
            for t in entry.get("tensors", []):
                info = header.tensors.get(t["name"])
                if info is None or list(info.shape) != t["shape"] or info.dtype.name != t["dtype"]:
                    raise GkError(f"{p}: tensor {t['name']} does not match the manifest")
            self._maps[rel] = MappedFile(header, private=True)
        return self._maps[rel]

    def load_rank(self, rank: int) -> dict:
        """{argument name: torch tensor} of what one rank's device programs read, sharing the
        mapped file pages."""
        return self._load(self.rank_info(rank)["loads"])

    def load_host(self) -> dict:
        """{name: torch tensor} of the host-side files (the embedding table when the runtime embeds)."""
        return self._load(self.manifest["host_files"])

    def _load(self, loads: list[dict]) -> dict:
        import torch

        out = {}
        for load in loads:
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

    def release_pages(self, prefix: str) -> None:
        """Drop the mapped pages of the shard files under ``prefix`` from this process (they stay
        in the page cache): an emulation of many ranks keeps its memory bounded this way."""
        for rel, mapped in self._maps.items():
            if rel.startswith(prefix):
                mapped.release(0, mapped.header.size)

    @property
    def store_read(self) -> dict | None:
        """Of a build read from a store: {"read": bytes read from its blobs, "stored": their size}."""
        if self._opener is None:
            return None
        return {"read": self._opener.read, "stored": self._opener.stored}

    def need_layer(self, i: int) -> None:
        """Layer i's weights are about to be read: a store opener that holds its shards a layer at
        a time (``publish.shards``) fetches them now; a folder's files are mapped whole."""
        if self._opener is not None:
            self._opener.need_layer(i)

    def done_layer(self, i: int) -> None:
        """Layers up to i are done with: such an opener returns their memory."""
        if self._opener is not None:
            self._opener.done_layer(i)

    def program(self, name: str):
        """A compiled program (``decode`` or ``tail``) of a cpu/cuda build, loaded only after its
        bytes, target and torch version are checked against the manifest (it is native code)."""
        import torch

        from .compile import inductor
        from .pipeline.fingerprint import sha256_file

        art = next((a for a in self.manifest["compile"]["artifacts"] if a["name"] == name), None)
        if art is None or art["path"] is None:
            raise GkError(f"{self.root}: no compiled {name} program ({self.manifest['compile']['status']})")
        if art["format"] != "aoti-pt2":
            raise GkError(f"{self.root}: the {name} program is a {art['format']}; it runs on {art['target']}, not here")
        p = inside(self.root, art["path"])
        if not p.is_file():
            raise GkError(f"{p}: missing (listed in the manifest)")
        digest = sha256_file(p)  # native code: always hashed, whatever ``verify`` says
        if digest != art["sha256"]:
            raise GkError(f"{p}: refused: sha256 {digest[:16]}... is not the manifest's {art['sha256'][:16]}... "
                          f"(the file changed since it was built)")
        if art["compiler"]["version"] != torch.__version__:
            raise GkError(f"{p}: refused: compiled by torch {art['compiler']['version']}, this is torch "
                          f"{torch.__version__}")
        if art["target"] == "cuda" and not torch.cuda.is_available():
            raise GkError(f"{p}: refused: built for cuda, and no GPU is available here")
        target = inductor.target_of(art["flags"])
        why = inductor.cannot_run(target)
        if why:
            raise GkError(f"{p}: refused: native code {why}")
        with inductor.quiet_portable_load(target):
            return torch._inductor.aoti_load_package(str(p))

    def layout_doc(self, kind: str) -> dict:
        """``layout/kv.json`` or ``layout/tail.json``, checked against the manifest like a shard
        (read once: ``open`` holds both to the manifest, ``layout.validate``)."""
        if kind not in self._layouts:
            p = self.file(self.manifest["layout"][kind]["file"])
            doc = jsonio.read(p, mf.MAX_MANIFEST)
            if not isinstance(doc, dict):
                raise GkError(f"{p}: not a JSON object")
            self._layouts[kind] = doc
        return self._layouts[kind]

    def kv_layout(self) -> KvLayout:
        return self._kv

    def allocate_kv(self, num_blocks: int | None = None, one_layer: bool = False) -> KvBuffers:
        """Zeroed KV buffers for one rank in the build's form (optionally fewer blocks than the
        build's budget; ``one_layer``: the entry of one layer only, which verify's layer-major
        replay reuses from layer to layer)."""
        import torch

        lay = self.kv_layout()
        if num_blocks is not None:
            if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 0 < num_blocks <= lay.num_blocks:
                raise GkError(f"allocate_kv: num_blocks {num_blocks!r} is not in 1..{lay.num_blocks} (the build's budget)")
            lay = dataclasses.replace(lay, num_blocks=num_blocks)
        if one_layer:
            lay = dataclasses.replace(lay, num_layers=1)
        need = lay.bytes_per_rank
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > have:
            raise GkError(f"{self.root}: the KV cache needs {need / 2**30:.1f} GiB, more than this host's "
                          f"{have / 2**30:.1f} GiB of memory; pass allocate_kv(num_blocks=...) for fewer blocks")
        dt = torch.bfloat16 if lay.dtype == "bf16" else torch.float8_e4m3fn
        return KvBuffers(lay, [torch.zeros(lay.allocation_shape, dtype=dt) for _ in range(lay.allocations)])

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        if self._opener is not None:
            self._opener.close()
            self._checked.clear()

