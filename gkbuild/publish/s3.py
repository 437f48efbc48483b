"""A store in S3: ``s3://BUCKET/PREFIX`` holding the folder store's tree (``publish.json`` +
``blobs/``), behind the same interface, so publish and fetch apply every check they apply to a
folder (hashes, paths, sizes, bombs, versions, resume) to a bucket too.

Commit order is the folder store's: blobs first (each a content-named object, created with
``If-None-Match: *``; large ones as multipart uploads that a re-run resumes part by part), the
index last, written over exactly the index this publish read (``If-Match`` on its ETag, or
``If-None-Match: *`` for a first publish). Of two concurrent publishers the second to commit is
refused; a reader never sees half a build. A fetch reads the index once and every blob pinned to
the ETag it had when opened (s3fs reads with ``If-Match``), so a blob replaced mid-read fails.
"""

from __future__ import annotations

import contextlib
import os
from typing import BinaryIO, Iterator

from .. import s3
from ..errors import GkError
from .index import NAME, is_blob
from .stores import MAX_INDEX, raced, refuse_foreign

READ_BLOCK = 16 << 20  # bytes a ranged GET asks for while a blob streams


class S3Store:
    # Reused blobs are not re-read on publish: that would download every blob of the build each
    # time. S3 checksums objects at rest, and a blob edited by hand still fails every fetch (each
    # byte is hashed against the manifest), so the damage is a refused fetch, never a wrong build.
    verifies_blobs = False
    leases = True  # blobs land before the index: a concurrent --prune must see a publish in progress

    def __init__(self, ref: s3.S3Ref, fs=None):
        self.ref, self.uri = ref, ref.uri
        self._fs = fs
        self.concurrency = max(8, os.cpu_count() or 1)  # network-bound: keep several transfers going
        self.etag: str | None = None  # the index's ETag as read (None: no index yet)

    @property
    def fs(self):
        if self._fs is None:
            self._fs = s3.filesystem()
        return self._fs

    def _errors(self):
        return s3.errors(self.uri)

    def get(self, name: str, limit: int = MAX_INDEX) -> bytes | None:
        """A small object, or None when it does not exist; larger than ``limit`` is refused unread."""
        got = self._read(name, limit)
        return got[0] if got else None

    def _read(self, name: str, limit: int = MAX_INDEX) -> tuple[bytes, str] | None:
        """(bytes, ETag), as ``get``."""
        with self._errors():
            try:
                f = self.fs.open(self.ref.path(name), "rb")
            except FileNotFoundError:
                self._bucket()
                return None
            with f:
                etag = f.details.get("ETag")
                if etag is None or f.details.get("type", "file") != "file":
                    raise GkError(f"{self.uri}/{name}: is a prefix holding other objects, not an object; refused")
                if f.size > limit:
                    raise GkError(f"{self.uri}/{name}: {f.size} bytes; refusing to read more than {limit}")
                return f.read(limit + 1), etag

    def require(self) -> None:
        """The bucket must be there (an empty prefix is an empty store)."""
        self._bucket()

    def _bucket(self) -> None:
        with self._errors():
            if not self.fs.exists(self.ref.bucket):
                raise GkError(f"{self.uri}: the bucket does not exist (gkbuild never creates buckets)")

    def read_index(self) -> bytes | None:
        got = self._read(NAME)
        if got is None:
            return None
        data, self.etag = got
        return data

    @contextlib.contextmanager
    def open_blob(self, name: str) -> Iterator[BinaryIO]:
        with self._errors():
            try:
                f = self.fs.open(self.ref.path(name), "rb", block_size=READ_BLOCK, cache_type="readahead")
            except (FileNotFoundError, IsADirectoryError):
                raise GkError(f"{self.uri}/{name}: a blob is missing from the store") from None
            with f:
                yield f

    def read_range(self, name: str, offset: int, n: int) -> bytes:
        """Exactly bytes [offset, offset + n) of a blob, one ranged GET (``publish.frames``)."""
        with self._errors():
            try:
                data = self.fs.cat_file(self.ref.path(name), start=offset, end=offset + n)
            except FileNotFoundError:
                raise GkError(f"{self.uri}/{name}: a blob is missing from the store") from None
        if len(data) != n:
            raise GkError(f"{self.uri}/{name}: ends before byte {offset + n}; the blob changed during the verify")
        return data

    def _objects(self, folder: str) -> dict[str, dict]:
        """Objects under ``folder`` (one level): name relative to the prefix -> s3fs's details."""
        with self._errors():
            try:
                found = self.fs.ls(self.ref.path(folder), detail=True)
            except FileNotFoundError:
                return {}
        cut = len(self.ref.path(""))
        return {e["name"][cut:]: e for e in found if e.get("type") == "file"}

    def list(self, folder: str) -> dict[str, int]:
        """Objects under ``folder`` (one level): name -> size."""
        return {n: e["size"] for n, e in self._objects(folder).items()}

    def modified(self, folder: str) -> dict[str, float]:
        """When each object under ``folder`` was last written (S3's LastModified: the server's clock)."""
        return {n: e["LastModified"].timestamp() for n, e in self._objects(folder).items()
                if hasattr(e.get("LastModified"), "timestamp")}

    def stored(self) -> dict[str, int]:
        return {k: v for k, v in self.list("blobs").items() if is_blob(k)}

    def prepare(self) -> None:
        """Refuse a prefix that holds other things and no index (the folder store's refusal)."""
        self._bucket()
        with self._errors():
            names = []
            if self.etag is None:
                with contextlib.suppress(FileNotFoundError):
                    names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.ref.path(""))]
        refuse_foreign(self.uri, names, self.etag is not None)

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        """A blob streamed up as it is written; created only once complete. An interrupted
        multipart upload stays for the next publish to resume."""
        up = s3.Upload(self.fs, self.ref, name, s3.PART)
        with self._errors():
            yield up
            up.close()

    def put(self, name: str, data: bytes, create: bool = True) -> None:
        """A small object, created only if absent (``create``): ``s3.Conflict`` otherwise."""
        with self._errors():
            s3.put(self.fs, self.ref, name, data, create=create)

    def delete(self, names: list[str]) -> None:
        if names:
            with self._errors():
                self.fs.rm([self.ref.path(n) for n in names])

    def temporaries(self) -> list[str]:
        """None to remove: an interrupted multipart upload stays for the next publish to resume."""
        return []

    def discard(self) -> None:
        """Nothing to undo: blobs are content-named and invisible until an index names them."""

    def commit(self, index: bytes, added: list[str], message: str) -> str:
        try:
            with self._errors():
                etag = s3.put(self.fs, self.ref, NAME, index, create=self.etag is None, etag=self.etag)
        except s3.Conflict:
            raise GkError(raced(self.uri)) from None
        self.etag = etag
        return f"{self.uri}/{NAME} (ETag {etag.strip(chr(34))})"
