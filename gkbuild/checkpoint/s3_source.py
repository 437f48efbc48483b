"""``s3://BUCKET/PREFIX`` checkpoint sources: a checkpoint in the HF layout mirrored to a bucket
(``config.json``, the safetensors index, the weight files it names) read through a local,
content-verified cache, ``$GKBUILD_CACHE/s3/BUCKET/PREFIX/``.

Only what a build reads is downloaded (planning: ``config.json`` alone). Each file is checked
against S3's own record of it before it takes its name: the size, and the ETag where it is an MD5
(a single-part upload: the MD5 of the bytes; a multipart one: the MD5 of the parts' MD5s, the part
size read from the object's first part); objects encrypted with SSE-KMS or SSE-C have no MD5
ETag and are checked by size, then by the safetensors validation every source gets. A large file
is read as parallel ranged GETs (one S3 stream tops out far below a host's bandwidth); its
sha256 is computed in the same pass as the MD5 and remembered, so the build never hashes it again.
A cached file is reused while the object's ETag and size and the local file's size and mtime are
what was recorded; an interrupted download leaves only a ``.partial`` file, redone next time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import s3
from ..errors import GkError, shown
from ..paths import create, file_lock
from ..pipeline.fingerprint import Fingerprints
from ..pipeline.state import read_json_record, write_json_atomic
from ..progress import Advance, warn
from .reader import INDEX, SINGLE, read_index
from .source import cache_root

RANGE = 32 << 20  # bytes a ranged GET reads
STREAMS = 8  # ranged GETs in flight a file
CHUNK = 8 << 20
RECORD = ".gkbuild-s3.json"
MAX_SMALL = 64 << 20  # config.json and the index are read whole: never more than this


def cache_dir(ref: s3.S3Ref) -> Path:
    return cache_root() / "s3" / ref.bucket / (ref.prefix or "_root")


def _record_problem(d) -> str | None:
    """Why a mirror record is not one this module wrote (it is then set aside, never trusted)."""
    if not isinstance(d, dict):
        return "not a JSON object"
    for name, r in d.items():
        ok = (isinstance(r, dict) and isinstance(r.get("etag"), str) and isinstance(r.get("sha256"), str)
              and all(isinstance(r.get(k), int) and not isinstance(r[k], bool) for k in ("size", "mtime_ns")))
        if not ok:
            return f"the entry for {shown(name)} is malformed"
    return None


class _Mirror:
    """One source's local cache: what was verified (name -> etag, size, mtime_ns, sha256)."""

    def __init__(self, uri: str):
        self.ref, self.uri = s3.parse(uri), uri
        self.dir = cache_dir(self.ref)
        self.fs = s3.filesystem()
        self.record = read_json_record(self.dir / RECORD, _record_problem) or {}
        self.lock = threading.Lock()
        self.fps = Fingerprints(cache_root())

    def listing(self) -> dict[str, dict]:
        """The objects directly under the prefix: name -> {size, ETag}."""
        with s3.errors(self.uri):
            try:
                found = self.fs.ls(self.ref.path(""), detail=True)
            except FileNotFoundError:
                found = []
            if not found and not self.fs.exists(self.ref.bucket):
                raise GkError(f"source {self.uri}: the bucket does not exist")
        cut = len(self.ref.path(""))
        return {e["name"][cut:]: e for e in found if e.get("type") == "file"}

    def get(self, name: str, obj: dict | None, advance: Advance = lambda n: None, limit: int | None = None) -> Path:
        """The verified local copy of ``name`` (downloaded unless the cache holds this version)."""
        if obj is None:
            raise GkError(f"source {self.uri}: no {name} in the bucket")
        if limit is not None and obj["size"] > limit:
            raise GkError(f"source {self.uri}/{name}: {obj['size']} bytes; refusing to read more than {limit}")
        local = self.dir / name
        if self._cached(name, obj, local):
            return local
        self.dir.mkdir(parents=True, exist_ok=True)
        with file_lock(self.dir / f".{name}.lock"):  # one download of a file at a time, across processes
            if self._cached(name, obj, local):  # another process got it meanwhile
                return local
            for stale in self.dir.glob(f".{name}.*.partial"):  # a killed download's (we hold the lock)
                stale.unlink()
            tmp = self.dir / f".{name}.{os.getpid()}.partial"
            try:
                with s3.errors(self.uri):
                    head = self.fs.call_s3("head_object", Bucket=self.ref.bucket, Key=self.ref.key(name))
                    if head["ETag"] != obj["ETag"] or head["ContentLength"] != obj["size"]:
                        raise GkError(f"source {self.uri}/{name}: changed while being read; run again")
                    self._download(name, obj, tmp, advance)
                    sha = self._verify(name, head, tmp)
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)
        st = local.stat()
        with self.lock:  # other processes' entries kept, this file's replaced
            self.record = {**(read_json_record(self.dir / RECORD, _record_problem) or {}), **self.record,
                           name: {"etag": obj["ETag"], "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}}
            write_json_atomic(self.dir / RECORD, self.record)
            self.fps.remember(local, sha)  # the build reuses this hash instead of reading the file again
            self.fps.save()
        return local

    def _cached(self, name: str, obj: dict, local: Path) -> bool:
        """Whether the cache holds this version of ``name``: by this process's record or the one on
        disk (another process may have written it since; it never replaces an entry here, which a
        concurrent download of another file by this process could otherwise lose)."""
        if not local.is_file():
            return False
        st = local.stat()
        with self.lock:
            disk = read_json_record(self.dir / RECORD, _record_problem) or {}
            candidates = (self.record.get(name), disk.get(name))
        return any(rec and rec["etag"] == obj["ETag"] and [rec["size"], rec["mtime_ns"]] == [obj["size"], st.st_mtime_ns]
                   and st.st_size == rec["size"] for rec in candidates)

    def _download(self, name: str, obj: dict, tmp: Path, advance: Advance) -> None:
        """Parallel ranged GETs, each read in chunks and written at its offset, pinned to the
        object's ETag (s3fs reads with If-Match), so a replaced object fails instead of mixing."""
        size = obj["size"]
        fd = create(tmp)
        try:
            os.ftruncate(fd, size)

            def one(start: int) -> None:
                end = min(start + RANGE, size)
                with self.fs.open(self.ref.path(name), "rb", block_size=CHUNK, cache_type="none") as f:
                    if f.details.get("ETag") != obj["ETag"]:
                        raise GkError(f"source {self.uri}/{name}: changed while being read; run again")
                    f.seek(start)
                    pos = start
                    while pos < end:
                        data = f.read(min(CHUNK, end - pos))
                        if not data:
                            raise GkError(f"source {self.uri}/{name}: ended at {pos} of {size} bytes")
                        os.pwrite(fd, data, pos)
                        pos += len(data)
                        advance(len(data))

            with ThreadPoolExecutor(STREAMS) as pool:
                list(pool.map(one, range(0, size, RANGE)))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _verify(self, name: str, head: dict, tmp: Path) -> str:
        """The sha256 of the downloaded file, once its size and MD5 ETag match S3's."""
        where = f"source {self.uri}/{name}"
        if tmp.stat().st_size != head["ContentLength"]:
            raise GkError(f"{where}: downloaded {tmp.stat().st_size} bytes, S3 says {head['ContentLength']}")
        etag = head["ETag"].strip('"')
        md5_etag = not (head.get("ServerSideEncryption") == "aws:kms" or head.get("SSECustomerAlgorithm"))
        digest, _, parts = etag.partition("-")
        part = head["ContentLength"] or 1
        if md5_etag and parts:
            part = self.fs.call_s3("head_object", Bucket=self.ref.bucket, Key=self.ref.key(name),
                                   PartNumber=1)["ContentLength"]
        sha, md5s, cur, filled = hashlib.sha256(), [], hashlib.md5(usedforsecurity=False), 0
        with open(tmp, "rb") as f:
            while piece := f.read(CHUNK):
                sha.update(piece)
                view = memoryview(piece)
                while view:  # one MD5 a part (the whole file is one part when the ETag is plain)
                    take = min(len(view), part - filled)
                    cur.update(view[:take])
                    filled, view = filled + take, view[take:]
                    if filled == part:
                        md5s.append(cur.digest())
                        cur, filled = hashlib.md5(usedforsecurity=False), 0
        if filled:
            md5s.append(cur.digest())
        if md5_etag:
            got = (f"{hashlib.md5(b''.join(md5s), usedforsecurity=False).hexdigest()}-{len(md5s)}" if parts
                   else (md5s[0].hex() if md5s else hashlib.md5(b"", usedforsecurity=False).hexdigest()))
            if got != etag:
                raise GkError(f"{where}: the downloaded bytes do not match S3's ETag ({got} != {etag}); refused")
        else:
            warn(f"{where}: encrypted with {head.get('ServerSideEncryption') or 'SSE-C'}, so its ETag is not an MD5; "
                 f"checked by size and by the checkpoint's validation only")
        return sha.hexdigest()


def fetch_config(uri: str) -> Path:
    """Only ``config.json`` (what planning needs); returns its path."""
    m = _Mirror(uri)
    return m.get("config.json", m.listing().get("config.json"), limit=MAX_SMALL)


def resolve(uri: str, advance: Advance = lambda n: None) -> Path:
    """Download (or find in the cache) config.json, the index and exactly the weight files it
    names; returns the local folder."""
    m = _Mirror(uri)
    objs = m.listing()
    m.get("config.json", objs.get("config.json"), limit=MAX_SMALL)
    if INDEX in objs:
        idx = m.get(INDEX, objs[INDEX], limit=MAX_SMALL)
        files = sorted(set(read_index(idx, f"source {uri}/{INDEX}").values()))
    else:
        files = [SINGLE]
    bad = [f for f in files if not isinstance(f, str) or Path(f).name != f or f.startswith(".")]
    if bad:
        raise GkError(f"source {uri}: {INDEX} names weight files outside the prefix: {bad[:3]}")
    with ThreadPoolExecutor(min(4, len(files))) as pool:  # small files side by side; large ones range-split
        list(pool.map(lambda f: m.get(f, objs.get(f), advance), files))
    return m.dir


def tokenizer_files(uri: str, names: tuple[str, ...]) -> Path:
    """The local folder with the source's tokenizer files (those of ``names`` under the prefix)."""
    m = _Mirror(uri)
    objs = m.listing()
    for name in names:
        if name in objs:
            m.get(name, objs[name], limit=MAX_SMALL)
    return m.dir
