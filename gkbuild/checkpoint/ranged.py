"""Checkpoints read by byte range, never mirrored: ``s3://BUCKET/PREFIX`` through s3fs and
``hf://ORG/NAME@REV`` through huggingface_hub's HfFileSystem (what ``gkbuild compile --to``
reads; a plain ``compile`` keeps the verified local mirror of ``s3_source``/``hub``).

A tensor, or the leading slice [lo, hi) of one, is one ranged GET of exactly its bytes. Behaviour
relied on, from the installed wheels (fsspec 2026.9.0, s3fs 2026.9.0, huggingface_hub 1.33.0):
- a file opened with ``cache_type="none"`` fetches what a ``read`` asks for in one call:
  ``AbstractBufferedFile.read`` calls ``self.cache._fetch(loc, loc + length)``
  (fsspec/spec.py:2189), and the "none" cache's ``_fetch`` returns ``self.fetcher(start, stop)``
  (fsspec/caching.py:51,63-70);
- s3fs reads a file opened for reading with ``IfMatch`` set to the ETag it saw when opening
  (s3fs/core.py:2629-2638), so an object replaced mid-build fails the read instead of mixing two
  versions; the ETag is also checked against the driver's listing here;
- ``HfFileSystem.open(path, revision=...)`` (huggingface_hub/hf_file_system.py:390) resolves the
  revision; ``HfFileSystemFile._fetch_range`` sends ``range: bytes=start-(end-1)`` (:1197-1205).
  A hub read is pinned to the commit the revision pointed to when the driver listed the repo,
  and an LFS file's sha256 comes from the listing's ``lfs`` entry (:622) without reading it.

A job of several consecutive shards of one role (``group``: experts r0..r1, vocab slices v0..v1,
TP ranks' heads) fetches each tensor's rows for the whole group in one GET when that is small
(``WINDOW``), keeps it in a small memo of the last ranges read (bounded in bytes), and cuts each
shard's slice from it: a tiny model's thousands of small slices become a few GETs, and every
byte is still read once (groups do not overlap). Only what another read may want again is memoized
(a group's window, a whole tensor): a shard's own rows never are. A shard reads every layer before
the next shard of its group starts, so a memo that also held its own rows (an expert shard's 8.3 MB
of gate_up blocks a layer) cycled its group's windows out before the next shard came for them
once the layers outgrew it: at 8 layers of the 120b shape the ranges were 1.83x the source (1.02x
at 4), the scales' windows re-read by every shard.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import jsonio, s3
from ..errors import GkError
from ..model import GptOssConfig
from .reader import INDEX, MAX_INDEX, SINGLE, Checkpoint, weight_map
from .safetensors_io import header_bytes, parse_header

MEMO_BYTES = 128 << 20  # many group windows (WINDOW each) with room to spare; one memo a worker
WINDOW = 1 << 20  # the most a group's read-ahead of one tensor fetches at once: the small tensors (biases)
# whose per-shard GETs would be many and tiny; a 120b shard's windows over 36 layers then stay ~10 MB
MAX_CONFIG = 1 << 20


class Location(str):
    """A remote file or folder as messages name it (``s3://bucket/ckpt/model.safetensors``)."""

    @property
    def name(self) -> str:
        return self.rsplit("/", 1)[-1]

    def __truediv__(self, other: str) -> "Location":
        return Location(f"{self}/{other}")


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    tag: str  # what a read is pinned to: the S3 ETag, or the hub commit
    sha256: str | None  # known without reading (a hub LFS file), else None


class Remote:
    """One remote checkpoint: its files (listed once) and ranged reads of them. ``pin`` (the hub
    commit, or each S3 file's ETag) is what the driver listed; a worker passes it on."""

    def __init__(self, uri: str, pin: dict | None = None, api=None, fs=None):
        """``api``/``fs``: huggingface_hub's ``HfApi``/``HfFileSystem`` (or stand-ins: tests)."""
        self.uri, self.pin, self._api = uri, dict(pin or {}), api
        if uri.startswith("s3://"):
            self.ref, self.kind = s3.parse(uri), "s3"
            self.fs = s3.filesystem()
        else:
            from . import hub

            self.ref, self.kind = hub.parse(uri), "hf"
            self.fs = fs
        self._files: dict[str, RemoteFile] | None = None
        self._open: dict[str, object] = {}
        self.read_bytes = 0  # every byte read from the source (headers, hashes and tensors alike)

    def errors(self):
        if self.kind == "s3":
            return s3.errors(f"source {self.uri}")
        from .hub import errors

        return errors(self.uri, self.ref.revision)

    def _hubfs(self):
        """The hub's file system, with the commit the revision points to pinned first."""
        if "commit" not in self.pin:
            from huggingface_hub import HfApi

            with self.errors():
                self.pin["commit"] = (self._api or HfApi()).repo_info(self.ref.repo, revision=self.ref.revision).sha
        if self.fs is None:
            from huggingface_hub import HfFileSystem

            self.fs = HfFileSystem()
        return self.fs

    def path(self, name: str) -> str:
        return self.ref.path(name) if self.kind == "s3" else f"{self.ref.repo}/{name}"

    def files(self) -> dict[str, RemoteFile]:
        """The files directly under the prefix (or at the repo root): name -> RemoteFile."""
        if self._files is None:
            with self.errors():
                if self.kind == "s3":
                    try:
                        found = self.fs.ls(self.ref.path(""), detail=True)
                    except FileNotFoundError:
                        found = []
                    cut = len(self.ref.path(""))
                    self._files = {e["name"][cut:]: RemoteFile(e["name"][cut:], e["size"], e["ETag"], None)
                                   for e in found if e.get("type") == "file"}
                else:
                    fs = self._hubfs()
                    found = fs.ls(self.ref.repo, detail=True, revision=self.pin["commit"])
                    cut = len(self.ref.repo) + 1
                    self._files = {e["name"][cut:]: RemoteFile(e["name"][cut:], e["size"], self.pin["commit"],
                                                               (e.get("lfs") or {}).get("sha256"))
                                   for e in found if e.get("type") == "file"}
            if self.kind == "s3":
                for name, f in self._files.items():
                    if self.pin.setdefault(name, f.tag) != f.tag:
                        raise GkError(f"source {self.uri}/{name}: changed since the build listed it; run again")
        return self._files

    def file(self, name: str) -> RemoteFile:
        f = self.files().get(name)
        if f is None:
            raise GkError(f"source {self.uri}: no {name}")
        return f

    def handle(self, name: str):
        """An open, pinned file of the checkpoint (one a file a process, kept open)."""
        if name not in self._open:
            f = self.file(name)
            with self.errors():
                if self.kind == "s3":
                    h = self.fs.open(self.path(name), "rb", cache_type="none")
                    if h.details.get("ETag") != f.tag:
                        raise GkError(f"source {self.uri}/{name}: changed since the build listed it; run again")
                else:
                    h = self._hubfs().open(self.path(name), "rb", revision=self.pin["commit"], cache_type="none")
            self._open[name] = h
        return self._open[name]

    def read(self, name: str, start: int, n: int) -> bytes:
        """Exactly bytes [start, start + n) of ``name``, one ranged GET."""
        if n == 0:
            return b""
        expired: tuple = ()
        if self.kind == "s3":  # what S3File._fetch_range raises when its If-Match fails (s3fs/core.py:2729)
            from s3fs.utils import FileExpired

            expired = (FileExpired,)
        h = self.handle(name)
        with self.errors():
            try:
                h.seek(start)
                data = h.read(n)
            except expired:
                raise GkError(f"source {self.uri}/{name}: changed since the build listed it; run again") from None
        self.read_bytes += len(data)
        if len(data) != n:
            raise GkError(f"source {self.uri}/{name}: ended at byte {start + len(data)}, expected {start + n}")
        return data

    def small(self, name: str, limit: int) -> bytes:
        """A small file read whole (config.json, the index), bounded before reading."""
        f = self.file(name)
        if f.size > limit:
            raise GkError(f"source {self.uri}/{name}: {f.size} bytes; refusing to read more than {limit}")
        return self.read(name, 0, f.size)

    def sha256(self, name: str, advance=lambda n: None, chunk: int = 32 << 20) -> str:
        """The file's sha256, read once in order (what the manifest records of each source file)."""
        f = self.file(name)
        if f.sha256:
            return f.sha256
        h = hashlib.sha256()
        for start in range(0, f.size, chunk):
            data = self.read(name, start, min(chunk, f.size - start))
            h.update(data)
            advance(len(data))
        return h.hexdigest()

    def weight_files(self) -> tuple[list[str], dict[str, str] | None]:
        """(the weight files, the index's weight map or None) as ``reader.weight_files`` finds them."""
        if INDEX in self.files():
            where = f"source {self.uri}/{INDEX}"
            wm = weight_map(jsonio.loads(self.small(INDEX, MAX_INDEX), where), where)
            files = sorted(set(wm.values()))
            bad = [f for f in files if "/" in f or f.startswith(".")]
            if bad:
                raise GkError(f"source {self.uri}/{INDEX}: names weight files outside the prefix: {bad[:3]}")
            for f in files:
                self.file(f)  # listed, or one line naming it
            return files, wm
        if SINGLE in self.files():
            return [SINGLE], None
        raise GkError(f"source {self.uri}: no {INDEX} and no {SINGLE}")

    def close(self) -> None:
        for h in self._open.values():
            with contextlib.suppress(Exception):
                h.close()
        self._open.clear()


def connect(uri: str, pin: dict | None = None, api=None, fs=None) -> Remote:
    """The remote checkpoint ``uri`` names: S3, the hub, or a synth:// one generated as it is read
    (``synth_ranged``); ``pin``: what an earlier listing of it saw (a worker gets the driver's)."""
    if uri.startswith("synth://"):
        from .synth_ranged import SynthRemote

        return SynthRemote(uri, pin)
    return Remote(uri, pin, api, fs)


class RangedCheckpoint(Checkpoint):
    """A ``Checkpoint`` whose ``read`` fetches exactly the bytes asked for (no mapping); the same
    validation and value checks as a local one."""

    remote: Remote
    fetched: int = 0  # bytes read from the source by this process
    group: tuple[int, int, int] | None = None  # (first, end, this) shard index of the job's group

    @classmethod
    def open_remote(cls, remote: Remote, plain: bool = False) -> "RangedCheckpoint":
        root = Location(remote.uri)
        config = GptOssConfig.from_hf(jsonio.loads(remote.small("config.json", MAX_CONFIG), root / "config.json"),
                                      where=root / "config.json")
        files, index = remote.weight_files()
        headers = {}
        for f in files:
            size = remote.file(f).size
            raw = header_bytes(_Reader(remote, f), size, root / f)
            headers[f] = parse_header(raw, size, root / f)
        ck = cls.assemble(root, config, headers, index, plain)
        ck.remote, ck.fetched, ck._memo, ck._held = remote, 0, OrderedDict(), 0
        return ck

    def read(self, name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        info = self.info(name)
        rows = info.shape[0] if info.shape else 1
        row = info.nbytes // max(rows, 1)
        if lo is not None:
            lo, hi = _bounds(lo, hi, rows)
        start, n = (info.offset, info.nbytes) if lo is None else (info.offset + lo * row, (hi - lo) * row)
        shape = info.shape if lo is None else (hi - lo, *info.shape[1:])
        window = self._window(lo, hi, rows, row)
        span = (info.offset + window[0] * row, (window[1] - window[0]) * row) if window else (start, n)
        dt = info.dtype.plain if self.plain else info.dtype.numpy
        keep = window is not None or lo is None  # a group's rows, or a tensor other shards read whole too
        arr = np.frombuffer(self._bytes(info.file.name, start, n, span, keep), dtype=dt).reshape(shape)
        return self._check(info, arr, lo, hi)

    def _window(self, lo: int | None, hi: int | None, rows: int, row: int) -> tuple[int, int] | None:
        """The rows of the whole group, when this read is shard ``this``'s share of them and small."""
        if lo is None or self.group is None or hi <= lo:
            return None
        first, end, this = self.group
        n = hi - lo
        if lo != this * n:
            return None
        w0, w1 = first * n, min(rows, end * n)
        return (w0, w1) if (w1 - w0) * row <= WINDOW else None

    def _bytes(self, file: str, start: int, n: int, span: tuple[int, int], keep: bool = True) -> memoryview:
        """Bytes [start, start + n) of ``file``: from a memoized range holding them, else fetched
        as ``span`` (which holds them), and memoized if ``keep``."""
        for (f, s, m), data in reversed(self._memo.items()):
            if f == file and s <= start and start + n <= s + m:
                self._memo.move_to_end((f, s, m))
                return data[start - s:start - s + n]
        s, m = span
        data = memoryview(self.remote.read(file, s, m))
        self.fetched += m
        if keep and m <= MEMO_BYTES:
            self._memo[(file, s, m)] = data
            self._held += m
            while self._held > MEMO_BYTES:
                self._held -= self._memo.popitem(last=False)[1].nbytes
        return data[start - s:start - s + n]

    def release(self, name: str, lo: int | None = None, hi: int | None = None) -> None:
        """Nothing is mapped: the bytes go with the arrays (the memo is bounded)."""

    def prefetch(self, name: str, lo: int, hi: int) -> None:
        """Nothing is mapped: the read fetches."""

    def close(self) -> None:
        self.remote.close()


def _bounds(lo: int, hi: int | None, rows: int) -> tuple[int, int]:
    """A slice's [lo, hi) as numpy would clip it."""
    lo, hi, _ = slice(lo, hi).indices(rows)
    return lo, max(lo, hi)


class _Reader:
    """A file-like ``read`` from position 0 onwards over a remote file (for ``header_bytes``)."""

    def __init__(self, remote: Remote, name: str):
        self.remote, self.name, self.pos = remote, name, 0

    def read(self, n: int) -> bytes:
        size = self.remote.file(self.name).size
        n = max(0, min(n, size - self.pos))
        data = self.remote.read(self.name, self.pos, n)
        self.pos += len(data)
        return data
