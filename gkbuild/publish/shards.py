"""A published build opened where it is stored: each file read from its blob when the runtime
first asks for it (its shards read ahead, side by side, from the first one on), decoded
(``codec``, as a fetch does) and hashed on the way, and refused by name if its bytes are not the
manifest's. Where the bytes then are:
- a raw blob of a folder store is the file's bytes where they lie: hashed in one streamed read,
  then mapped in place (read-only, as a build folder's file is);
- a shard stacked on the layer axis (experts, attention) is held in an anonymous in-memory file
  (``memfd``) without its layers' large ranges, which are fetched a layer at a time as the twins
  come to it and punched out after (``frames``; ``need_layer``/``done_layer``);
- any other file is decoded into a ``memfd`` whole.
The runtime maps each as it maps a file of a build folder, so everything past "where are the
bytes" is the same code; nothing lands on local disk, and the memory goes when the build is closed.

The store's index and manifest are checked first (``fetch.read_manifest``), and with ``trust`` the
signature over the manifest (``fetch.check_trust``), before any shard is read.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import dtypes
from ..errors import GkError
from . import codec, frames
from .fetch import check_trust, read_manifest
from .stores import open_store


def is_store(ref: str) -> bool:
    """``hf://...``, ``s3://...`` or a folder holding a publish index (not a build folder)."""
    from .index import NAME

    return "://" in str(ref) or (Path(ref) / NAME).is_file()


def twins_only(ref: str, engine: str, prefill: bool) -> None:
    """A store is verified through the twins (the compiled programs and the NEFFs run from a folder)."""
    if engine != "twin" or prefill:
        what = "--prefill nixl" if prefill else f"--engine {engine}"
        raise GkError(f"{ref}: a build verified where it is stored runs through the twins; fetch it "
                      f"(gkbuild fetch) for {what}")


class Held(os.PathLike):
    """A store file's verified bytes (a memfd, or the blob itself), opened through
    ``/proc/self/fd``; named in messages as the store's blob and the build's file."""

    def __init__(self, fd: int, where: str):
        self.fd, self.where = fd, where

    def __fspath__(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def __str__(self) -> str:
        return self.where


class Where(str):
    """A store's address standing where a build folder's path would, in messages (``/`` joins)."""

    def __truediv__(self, rel) -> "Where":
        return Where(f"{self}/{rel}")


def in_place_blob(store, entry: dict) -> bool:
    """Whether the file ``entry`` is mapped from its blob where it lies (a folder store's raw blob)
    rather than held in memory."""
    return entry["encoding"] == codec.RAW and hasattr(store, "blob_fd")


def held_bytes(store, idx: dict, m: dict) -> int:
    """The most memory the build's files take while they are verified in place: every file held
    whole but those mapped in place and, of the shards held a layer at a time (``frames``), what is
    not a layer's share of a large tensor plus three layers of that (the one run, the one read
    ahead, and the frames at their edges)."""
    L = m["model"]["num_hidden_layers"]
    entries = {e["path"]: e for e in idx["files"]}
    total = 0
    for f in m["files"]:
        e = entries.get(f["path"], {"encoding": None})
        if in_place_blob(store, e):
            continue
        ts = f.get("tensors") or []
        stacked = f["path"].startswith("weights/") and ts and all(t["shape"] and t["shape"][0] == L for t in ts)
        big = [t for t in ts if stacked and _nbytes(t) // L >= codec.FRAME]
        share = sum(_nbytes(t) for t in big)
        total += f["size"] - share + 3 * share // L
    return total


def _nbytes(t: dict) -> int:
    n = dtypes.dtype(t["dtype"]).itemsize
    for d in t["shape"]:
        n *= d
    return n


class _Discard:
    """A sink for ``codec.decode`` when only the hash of the bytes is wanted."""

    def write(self, data) -> int:
        return len(data)


class StoreFiles:
    """The opener ``runtime.Build`` reads a store's files through: ``path(rel)`` is a path
    to the verified bytes of the manifest's file ``rel`` (``Held``). The first shard asked for (``weights/``:
    the runtime maps every rank's at once) starts reading all of them, ``store.concurrency`` at a
    time in the order the ranks load them; each is handed over once it has checked out."""

    def __init__(self, store, idx: dict, m: dict):
        self.store = store
        self._entries = {f["path"]: f for f in idx["files"]}  # ``read_manifest``: the manifest's sizes and hashes
        order = [x["file"] for r in m["ranks"] for x in r["loads"]] + [x["file"] for x in m["host_files"]]
        self._shards = list(dict.fromkeys(f for f in order + sorted(self._entries) if f.startswith("weights/")))
        self._layers = m["model"]["num_hidden_layers"]
        self._ahead: dict[str, Future] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._fds: list[int] = []
        self.layered: dict[str, frames.Layered] = {}  # the shards held a layer at a time
        self._lock = threading.Lock()
        self.read = 0  # bytes read from the store's blobs
        self.stored = sum(e["stored_size"] for e in idx["files"])  # what they hold

    def path(self, rel: str) -> Held:
        if rel.startswith("weights/") and self._ahead is None:
            self._pool = ThreadPoolExecutor(max_workers=self.store.concurrency)
            self._ahead = {f: self._pool.submit(self._read, f) for f in self._shards}
        fut = (self._ahead or {}).get(rel)
        return fut.result() if fut is not None else self._read(rel)

    def need_layer(self, i: int) -> None:
        """Layer i of every shard held a layer at a time: fetched (its frames, checked) now."""
        layered = list(self.layered.values())
        if layered:
            list(self._pool.map(lambda f: f.fill(i), layered))

    def done_layer(self, i: int) -> None:
        """Layers up to i are done with: their memory is returned (asked for again, they are fetched again)."""
        for f in list(self.layered.values()):
            for j in range(i + 1):
                f.drop(j)

    def _read(self, rel: str) -> Held:
        e = self._entries[rel]
        where = f"{self.store.uri}/{e['blob']} ({rel})"
        in_place = in_place_blob(self.store, e)
        fd = self.store.blob_fd(e["blob"]) if in_place else os.memfd_create(rel.replace("/", "_"), os.MFD_CLOEXEC)
        try:
            got = self._by_layer(rel, e, fd, where) if not in_place and rel.startswith("weights/") else None
            if in_place:
                with open(fd, "rb", closefd=False) as src:
                    got = codec.decode(src, _Discard(), e["encoding"], e["size"], e["stored_size"], where)
            elif got is None:
                os.ftruncate(fd, 0)
                with self.store.open_blob(e["blob"]) as src, open(fd, "wb", closefd=False) as dst:
                    got = codec.decode(src, dst, e["encoding"], e["size"], e["stored_size"], where)
            self._count(e["stored_size"])
            if got != e["sha256"]:
                raise GkError(f"{where}: refused: sha256 {got[:16]}... is not the manifest's {e['sha256'][:16]}... "
                              f"(the blob changed since it was published)")
        except BaseException:
            with self._lock:
                self.layered.pop(rel, None)
            os.close(fd)
            raise
        with self._lock:
            self._fds.append(fd)
        return Held(fd, where)

    def _by_layer(self, rel: str, e: dict, fd: int, where: str) -> str | None:
        """Scan the blob into ``fd`` keeping out its layers' large ranges (``frames.scan``), which
        ``need_layer`` fetches later; the file's sha256, or None for a blob of one large frame."""
        os.ftruncate(fd, e["size"])
        with self.store.open_blob(e["blob"]) as src:
            got = frames.scan(src, e["encoding"], e["size"], e["stored_size"], where, fd, self._layers)
        if got is None:
            return None
        digest, table, spans = got
        if spans is not None and digest == e["sha256"]:
            def read(offset: int, n: int, blob=e["blob"]) -> bytes:
                self._count(n)
                return self.store.read_range(blob, offset, n)

            with self._lock:
                self.layered[rel] = frames.Layered(fd, table, spans, e["encoding"], read, where)
        return digest

    def _count(self, n: int) -> None:
        with self._lock:
            self.read += n

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._ahead = None, None
        self.layered.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def open_build(uri: str, trust: list | None = None, api=None, fs=None):
    """The build published at ``uri`` as a ``runtime.Build`` whose files are read from the store.
    Refused before any shard is read: an index or manifest that does not check out, a signature
    none of ``trust`` made, files held in memory (all but those mapped in place) that this host's
    memory could not hold at once."""
    from ..runtime import Build

    store = open_store(uri, api=api, fs=fs)
    idx, m, man_bytes = read_manifest(store)
    _, signed = check_trust(store, idx, m, man_bytes, trust)
    need = held_bytes(store, idx, m)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise GkError(f"{store.uri}: the build's files take {need / 2**30:.1f} GiB of memory as they are verified; "
                      f"this host has {have / 2**30:.1f} GiB")
    build = Build.made(Where(store.uri), m, man_bytes, "hash", StoreFiles(store, idx, m))
    build.signature = signed
    return build
