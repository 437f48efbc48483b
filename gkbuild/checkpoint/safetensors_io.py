"""safetensors files: a strict header reader and a positional, atomic writer.

gkbuild reads headers itself (rather than through ``safe_open``) so that every way a file can be
broken gets a message naming the file and the tensor, and maps data zero-copy with ``mmap``.
The writer knows every tensor's shape up front (from the plan), lays out the header first, then
accepts tensor bytes in any order and in chunks: shards are written incrementally and appear
under their final name only when complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import dtypes, jsonio
from . import direct_io
from ..errors import GkError, shown

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where arrays are made: planning needs only the specs and headers.
MAX_HEADER = 100 * 1024 * 1024
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    file: Path


@dataclass(frozen=True)
class Header:
    path: Path
    size: int
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def _whole(v) -> int:
    """A shape or offset: a JSON integer, never a float (960.5 would be truncated) or a bool."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(v)
    return v


def read_header(path: Path) -> Header:
    """Parse and fully validate a safetensors header against the file's real size. ``path``: a
    path, or an ``os.PathLike`` kept as it is (one whose ``str`` names the file in messages)."""
    path = path if isinstance(path, os.PathLike) else Path(path)
    try:
        with jsonio.open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = header_bytes(f, size, path)
    except FileNotFoundError:
        raise GkError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise GkError(f"{path}: is a folder, not a safetensors file") from None
    return parse_header(raw, size, path)


def header_bytes(f, size: int, path) -> bytes:
    """The JSON header of a safetensors file of ``size`` bytes open as ``f`` (a local file or a
    remote one read by range), its length bounded by the file and ``MAX_HEADER`` before reading."""
    head = f.read(8)
    if len(head) < 8:
        raise GkError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, MAX_HEADER):
        raise GkError(f"{path}: corrupt safetensors header: header length {n} exceeds the "
                      f"file's {size} bytes")
    raw = f.read(n)
    if len(raw) != n:
        raise GkError(f"{path}: truncated safetensors header ({len(raw)} of {n} bytes)")
    return raw


def parse_header(raw: bytes, size: int, path) -> Header:
    """Check a header's JSON against the file's ``size``: every tensor's dtype, shape and span.
    ``path`` names the file in messages (a ``Path``, or a remote location with a ``name``)."""
    try:
        obj = jsonio.loads(raw, f"{path}: corrupt safetensors header")
    except jsonio.BadJson as e:
        raise GkError(str(e)) from None
    if not isinstance(obj, dict):
        raise GkError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise GkError(f"{path}: corrupt safetensors header: __metadata__ is not a map of strings")
    data_start = 8 + len(raw)
    data_len = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, e in obj.items():
        try:
            dt = dtypes.from_safetensors(e["dtype"])
            shape = tuple(_whole(s) for s in e["shape"])
            begin, end = (_whole(v) for v in e["data_offsets"])
        except GkError as err:
            raise GkError(f"{path}: tensor {name}: {err}") from None
        except (KeyError, TypeError, ValueError):
            raise GkError(f"{path}: tensor {shown(name)}: malformed header entry {shown(e)}") from None
        if any(s < 0 for s in shape) or begin < 0 or end < begin:
            raise GkError(f"{path}: tensor {name}: invalid shape {list(shape)} or offsets [{begin}, {end}]")
        want = math.prod(shape) * dt.itemsize
        if end - begin != want:
            raise GkError(f"{path}: tensor {name}: header offsets [{begin}, {end}] hold {end - begin} bytes but "
                          f"{dt.name}{list(shape)} needs {want}")
        if end > data_len:
            raise GkError(f"{path}: truncated: tensor {name} ends at data byte {end} but the file holds only "
                          f"{max(data_len, 0)} data bytes")
        tensors[name] = TensorInfo(name, dt, shape, data_start + begin, want, path)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    pos = data_start
    for begin, end, name in spans:
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else "leaves a hole before it"
            raise GkError(f"{path}: corrupt safetensors header: tensor {name} {what} (offset {begin - data_start})")
        pos = end
    if pos != size:
        raise GkError(f"{path}: corrupt safetensors file: {size - pos} bytes after the last tensor")
    return Header(path, size, data_start, tensors, dict(meta))


class MappedFile:
    """A mapping of one file; tensor views share its memory (zero-copy).

    Read-only by default; ``private`` maps copy-on-write, so the views are writable arrays (torch
    wants those) while the file is never modified and unwritten pages stay shared.
    """

    def __init__(self, header: Header, private: bool = False, plain: bool = False):
        self.header = header
        self.plain = plain  # bf16 (fp8) views as their unsigned-int bits: no ml_dtypes (``DType.plain``)
        self._fd = os.open(header.path, os.O_RDONLY)
        access = mmap.ACCESS_COPY if private else mmap.ACCESS_READ
        self._mm = mmap.mmap(self._fd, 0, access=access) if header.size else None

    def array(self, info: TensorInfo) -> np.ndarray:
        import numpy as np

        dt = info.dtype.plain if self.plain else info.dtype.numpy
        if info.nbytes == 0:
            return np.empty(info.shape, dtype=dt)
        return np.frombuffer(self._mm, dtype=dt, count=math.prod(info.shape),
                             offset=info.offset).reshape(info.shape)

    # A page fault maps neighbouring cached pages too (fault-around, 64 KiB by default), so a
    # release reaches this far past both ends of the range it was asked for.
    FAULT_AROUND = 1 << 20
    MADV_POPULATE_READ = 22  # Linux 5.14+: map a range's pages in one call instead of a fault each

    def prefetch(self, offset: int, nbytes: int) -> None:
        """Start reading a byte range into the page cache and return (``MADV_WILLNEED``: exactly
        those bytes, in large requests)."""
        self._advise(mmap.MADV_WILLNEED, offset, nbytes)

    def populate(self, offset: int, nbytes: int) -> None:
        """Map a byte range's pages now, in one system call (a build reads every byte of what it
        asks for: faulting them in one 64 KiB group at a time cost a third of its system time).

        The range is first read into the page cache as it is (``prefetch``). A fault that finds a
        page missing reads the device's readahead window around it instead, and that window can be
        far larger than what is asked for (8 MiB on this project's hosts: a 36-layer golden, which
        reads one 13 MB expert at a time from a checkpoint larger than the page cache, read ~3x
        its bytes from disk, issue 28)."""
        self.prefetch(offset, nbytes)
        self._advise(self.MADV_POPULATE_READ, offset, nbytes)

    def _advise(self, advice: int, offset: int, nbytes: int) -> None:
        if not self._mm or nbytes <= 0:
            return
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._mm.madvise(advice, start, min(offset + nbytes, self.header.size) - start)
        except OSError:  # an older kernel: the pages fault in as they are read
            pass

    def release(self, offset: int, nbytes: int) -> None:
        """Drop the mapped pages of a byte range (and the fault-around margin) from this process;
        they stay in the page cache."""
        if not self._mm or nbytes <= 0:
            return
        page = mmap.PAGESIZE
        start = max(0, offset - self.FAULT_AROUND) // page * page
        end = min(offset + nbytes + self.FAULT_AROUND, self.header.size)
        self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # live views: the mapping goes when they do
                pass
        os.close(self._fd)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # gkbuild dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.dtype(self.dtype).itemsize


def layout_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The header bytes and each tensor's data offset (relative to the data section).

    Tensors are laid out by item size, largest first, so every tensor is aligned to its item size
    (the header is padded to 8 bytes and safetensors forbids holes); ties keep the given order.
    """
    order = sorted(range(len(specs)), key=lambda i: -dtypes.dtype(specs[i].dtype).itemsize)
    obj: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offsets: dict[str, int] = {}
    pos = 0
    for i in order:
        s = specs[i]
        st = dtypes.dtype(s.dtype).safetensors
        if st is None:
            raise GkError(f"tensor {s.name}: dtype {s.dtype} cannot be stored in safetensors")
        obj[s.name] = {"dtype": st, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        offsets[s.name] = pos
        pos += s.nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def syncfs(path: Path) -> None:
    """Flush every dirty page of the filesystem holding ``path`` (one call for many files)."""
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).syncfs(fd) != 0:
            os.sync()
    except OSError:
        os.sync()
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SafetensorsWriter:
    """Write one safetensors file whose tensor list is known up front, positionally: ``write`` in
    any order and chunking, from several threads.

    Bytes go to ``<path>.<pid>.<thread>.partial``; ``close()`` checks every byte was written,
    fsyncs and renames into place (``durable=False`` leaves the fsync to a caller that syncs the
    whole filesystem before it relies on the file). ``abort()`` removes the partial file. Use as a
    context manager: an exception aborts.
    """

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None,
                 durable: bool = True):
        self.path = Path(path)
        self.durable = durable
        # unique per writer: two writers of the same file never share a temporary
        self.tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        self.specs = {s.name: s for s in specs}
        if len(self.specs) != len(specs):
            raise GkError(f"{path}: duplicate tensor names")
        self.header, rel = layout_header(specs, metadata)
        self._base = len(self.header)
        self._offsets = {k: self._base + v for k, v in rel.items()}
        self.order = sorted(self.specs, key=lambda k: rel[k])
        self._written = {k: 0 for k in self.specs}
        self._lock = threading.Lock()
        self.size = self._base + sum(s.nbytes for s in specs)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open()

    def _open(self) -> int:
        fd = os.open(self.tmp, _CREATE, 0o644)
        os.ftruncate(fd, self.size)
        os.pwrite(fd, self.header, 0)
        return fd

    def write(self, name: str, data: np.ndarray, start: int = 0) -> None:
        """Write ``data`` (the tensor's dtype, C order) at element offset ``start`` of ``name``."""
        buf = self._bytes(name, data)
        pos = self._offsets[name] + start * dtypes.dtype(self.specs[name].dtype).itemsize
        self._check_room(name, pos, len(buf))
        direct_io.pwrite_all(self._fd, buf, pos, str(self.path))
        self._count(name, len(buf))

    def _bytes(self, name: str, data: np.ndarray) -> memoryview:
        import numpy as np

        spec = self.specs[name]
        if not dtypes.dtype(spec.dtype).holds(data.dtype):
            raise GkError(f"{self.path.name}: tensor {name} expects {spec.dtype}, got {data.dtype}")
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))

    def _check_room(self, name: str, pos: int, nbytes: int) -> None:
        if pos + nbytes > self._offsets[name] + self.specs[name].nbytes:
            raise GkError(f"{self.path.name}: write past the end of tensor {name}")

    def _count(self, name: str, nbytes: int) -> None:
        with self._lock:
            self._written[name] += nbytes

    def _finish(self) -> None:
        """Everything written reaches the file (a stream's staged bytes)."""

    def close(self) -> Path:
        short = [k for k, s in self.specs.items() if self._written[k] != s.nbytes]
        if short:
            self.abort()
            raise GkError(f"{self.path}: tensors not fully written: {short[:5]}")
        try:
            self._finish()
            if self.durable:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self.tmp, self.path)
        except BaseException:  # a full disk or a read-only folder: nothing half-written stays behind
            self.abort()
            raise
        if self.durable:
            fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class SafetensorsStream(SafetensorsWriter):
    """A safetensors file written front to back: ``append`` takes the tensors in file order
    (``order``), hashes the bytes as they go (``sha256`` after ``close``, no read-back), and writes
    them around the page cache (``direct_io``): a build writes its shards once and reads none back.
    """

    def _open(self) -> int:
        fd, direct = direct_io.open_direct(self.tmp, _CREATE)
        self._out = direct_io.DirectAppender(fd, direct, str(self.path))
        self._hash = hashlib.sha256(self.header)
        self._cursor = self._base  # next byte an append writes
        self.sha256: str | None = None
        self._out.put(memoryview(self.header))
        return fd

    def write(self, name: str, data: np.ndarray, start: int = 0) -> None:
        raise GkError(f"{self.path.name}: a stream is written front to back (append), not positionally")

    def append(self, name: str, data: np.ndarray) -> None:
        """Write the next bytes of the file, which must belong to tensor ``name``."""
        start = self._cursor - self._offsets[name]
        if not 0 <= start < self.specs[name].nbytes:
            raise GkError(f"{self.path.name}: tensor {name} appended out of file order")
        buf = self._bytes(name, data)
        self._check_room(name, self._cursor, len(buf))
        self._hash.update(buf)
        self._out.put(buf)
        self._cursor += len(buf)
        self._count(name, len(buf))

    def _finish(self) -> None:
        self._out.finish(self.size)
        self.sha256 = self._hash.hexdigest()

    def abort(self) -> None:
        self._out.close()
        super().abort()
