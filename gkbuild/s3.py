"""``s3://BUCKET/PREFIX`` locations through fsspec + s3fs (never hand-written HTTP).

Credentials, region and endpoint come from the standard AWS chain (``AWS_ACCESS_KEY_ID`` /
``AWS_PROFILE`` / an instance role; ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL_S3`` for an
S3-compatible server). This module holds what the s3 source, store and compile cache share: the
URI, one filesystem, errors as one line, conditional puts, and multipart uploads that resume.

Conditional writes: ``put(..., create=True)`` sends ``If-None-Match: *`` and ``put(..., etag=E)``
sends ``If-Match: E``; a server that refuses the condition raises ``Conflict``. AWS S3 (since
2024-11) and moto honour both. A server that ignores the headers writes unconditionally (the last
writer wins); one that rejects them says so in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Iterator

from .errors import GkError, shown

_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>[^\\\0]*))?$")
# S3's "safe characters" for object keys (AWS S3 User Guide, "Naming Amazon S3 objects") and '/',
# plus '=', '+', ',', '@' and '~', which need no encoding either.
_SAFE_PUNCTUATION = "/!-_.*'()=+,@~"
_SAFE = re.compile(rf"^[A-Za-z0-9{re.escape(_SAFE_PUNCTUATION)}]$")
PART = 16 << 20  # multipart part size: 10,000 parts reach 156 GiB; memory is one part a writer
MIN_PART = 5 << 20  # S3's smallest non-final part


class Conflict(GkError):
    """A conditional write lost: the object exists (create) or changed since it was read (etag)."""


@dataclass(frozen=True)
class S3Ref:
    bucket: str
    prefix: str  # no leading or trailing slash; "" for the bucket root

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def path(self, name: str) -> str:
        """The fsspec path of ``name`` under the prefix."""
        return f"{self.bucket}/{self.key(name)}"


def parse(uri: str) -> S3Ref:
    """An ``s3://BUCKET[/PREFIX]`` location, refused (before anything is read or written under it)
    unless its prefix is plain: S3's safe characters, no query (``?versionId=``) or fragment,
    which s3fs would read as a version rather than as part of a key."""
    m = _URI.match(uri)
    prefix = (m["prefix"] or "").strip("/") if m else ""
    if not m or (prefix and any(p in ("", ".", "..") for p in prefix.split("/"))):
        raise GkError(f"{shown(uri)}: expected s3://BUCKET[/PREFIX] (lower-case bucket, no '..' or empty parts)")
    odd = next((c for c in prefix if not _SAFE.match(c)), None)
    if odd is not None:
        why = "a query or fragment is not part of a location" if odd in "?#" else "not one of S3's safe key characters"
        raise GkError(f"{shown(uri)}: {odd!r} in the prefix: {why}; expected s3://BUCKET[/PREFIX] with letters, digits "
                      f"and {_SAFE_PUNCTUATION} only")
    return S3Ref(m["bucket"], prefix)


def filesystem():
    """An s3fs filesystem over the AWS chain (no listing cache: stores change under us). The
    endpoint is passed by name: fsspec hands back a cached instance for the same arguments
    (fsspec 2026.9.0, ``fsspec/spec.py:92-105`` ``_Cached.__call__`` tokenizes only them), so
    without it a process whose ``AWS_ENDPOINT_URL`` changed would keep talking to the old endpoint."""
    import s3fs

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    return s3fs.S3FileSystem(use_listings_cache=False, endpoint_url=endpoint)


def code(e: BaseException) -> str | None:
    """The S3 error code (``NoSuchKey``, ``PreconditionFailed``...) behind an s3fs or botocore error."""
    while e is not None:
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and resp.get("Error", {}).get("Code"):
            return str(resp["Error"]["Code"])
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def errors(uri: str) -> Iterator[None]:
    """S3 failures as one line naming the location and what to do."""
    from botocore.exceptions import BotoCoreError, EndpointConnectionError, NoCredentialsError

    try:
        yield
    except GkError:
        raise
    except NoCredentialsError:
        raise GkError(f"{uri}: no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
                      f"or run where an instance role is available)") from None
    except EndpointConnectionError as e:
        raise GkError(f"{uri}: cannot reach the S3 endpoint ({e}); check AWS_ENDPOINT_URL and the network") from None
    except (OSError, BotoCoreError) as e:
        c = code(e)
        if c == "NoSuchBucket":
            raise GkError(f"{uri}: the bucket does not exist") from None
        if c in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or isinstance(e, PermissionError):
            raise GkError(f"{uri}: access denied ({c or e}); check the AWS credentials and the bucket policy") from None
        raise GkError(f"{uri}: S3 request failed: {c + ': ' if c else ''}{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def put(fs, ref: S3Ref, name: str, body: bytes, create: bool = False, etag: str | None = None) -> str:
    """PUT ``body`` under ``name`` (create only, or only over ``etag``); returns the new ETag."""
    cond = {"IfNoneMatch": "*"} if create else {"IfMatch": etag} if etag else {}
    try:
        return fs.call_s3("put_object", Bucket=ref.bucket, Key=ref.key(name), Body=body, **cond)["ETag"]
    except OSError as e:
        _conditional(e, ref, name, cond)
        raise


def _conditional(e: OSError, ref: S3Ref, name: str, cond: dict) -> None:
    """Raise ``Conflict`` for a lost condition, or a clear line for a server that rejects it."""
    c = code(e)
    if c in ("PreconditionFailed", "ConditionalRequestConflict") and cond:
        raise Conflict(f"{ref.uri}/{name}: " + ("already exists" if "IfNoneMatch" in cond else
                                                  "changed since it was read (another writer landed first)")) from None
    if c in ("NotImplemented", "InvalidArgument") and cond:
        raise GkError(f"{ref.uri}: the S3 server rejects conditional writes ({c}); gkbuild needs If-None-Match / "
                      f"If-Match on PutObject (AWS S3, MinIO, moto have them)") from None


class Upload:
    """A write-only stream into one object: a single PUT when it fits in one part, else a multipart
    upload. The upload is created only once and resumed by the next writer of the same key: a part
    whose MD5 and size match one already uploaded (S3's part ETag is its MD5) is not sent again, so
    re-encoding the same content after an interruption costs CPU, not transfer. ``close`` completes
    it with ``If-None-Match: *``; losing that race to an identical blob (content-named keys) is fine."""

    def __init__(self, fs, ref: S3Ref, name: str, part_size: int = PART):
        self.fs, self.ref, self.name, self.part_size = fs, ref, name, max(part_size, MIN_PART)
        self.buf = bytearray()
        self.pos = 0
        self.upload_id: str | None = None
        self.remote: dict[int, tuple[str, int]] = {}  # part number -> (etag, size) of a resumed upload
        self.parts: list[dict] = []
        self.sent = self.reused = 0  # parts uploaded, parts reused from an earlier attempt

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        """Parts go up as they fill; nothing is held that a flush could send early."""

    def write(self, data) -> int:
        self.buf += data
        self.pos += len(data)
        while len(self.buf) > self.part_size:  # keep the tail back: only the last part may be short
            self._part(bytes(self.buf[:self.part_size]))
            del self.buf[:self.part_size]
        return len(data)

    def _start(self) -> None:
        key = self.ref.key(self.name)
        ups = self.fs.call_s3("list_multipart_uploads", Bucket=self.ref.bucket, Prefix=key).get("Uploads", [])
        mine = sorted((u for u in ups if u["Key"] == key), key=lambda u: u["Initiated"])
        if mine:
            self.upload_id = mine[-1]["UploadId"]
            got = self.fs.call_s3("list_parts", Bucket=self.ref.bucket, Key=key, UploadId=self.upload_id)
            self.remote = {p["PartNumber"]: (p["ETag"].strip('"'), p["Size"]) for p in got.get("Parts", [])}
        else:
            self.upload_id = self.fs.call_s3("create_multipart_upload", Bucket=self.ref.bucket, Key=key)["UploadId"]

    def _part(self, data: bytes) -> None:
        if self.upload_id is None:
            self._start()
        n = len(self.parts) + 1
        if n > 10_000:
            raise GkError(f"{self.ref.uri}/{self.name}: more than 10,000 parts of {self.part_size} bytes")
        md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
        if self.remote.get(n) == (md5, len(data)):
            self.reused += 1
        else:
            md5 = self.fs.call_s3("upload_part", Bucket=self.ref.bucket, Key=self.ref.key(self.name),
                                  UploadId=self.upload_id, PartNumber=n, Body=data)["ETag"].strip('"')
            self.sent += 1
        self.parts.append({"PartNumber": n, "ETag": f'"{md5}"'})

    def close(self) -> None:
        """Complete the object (the caller calls this only when every byte was written)."""
        if self.upload_id is None and len(self.buf) <= self.part_size:
            with contextlib.suppress(Conflict):
                put(self.fs, self.ref, self.name, bytes(self.buf), create=True)
            self.sent += 1
            return
        self._part(bytes(self.buf))
        self.buf = bytearray()
        cond = {"IfNoneMatch": "*"}
        try:
            self.fs.call_s3("complete_multipart_upload", Bucket=self.ref.bucket, Key=self.ref.key(self.name),
                            UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}, **cond)
        except OSError as e:
            with contextlib.suppress(Conflict):
                _conditional(e, self.ref, self.name, cond)
                raise
            self.fs.call_s3("abort_multipart_upload", Bucket=self.ref.bucket, Key=self.ref.key(self.name),
                            UploadId=self.upload_id)
