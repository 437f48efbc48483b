"""A stored shard read back one layer at a time, every byte checked against the manifest.

A build's shard stacks each per-layer weight on a leading layer axis, so one layer of it is a few
ranges of the file. Verify in place runs layer by layer (``kernels.replay``) and needs only those:

- ``scan`` reads the blob once from start to end, decoding it frame by frame (a zstd blob is a run
  of independent frames, ``codec.FRAME`` bytes each; a raw blob is cut into pieces of that size),
  hashes the whole (the caller holds it to the manifest's sha256) and each frame's decoded bytes,
  notes where each frame lies in the blob and in the file, and writes into the in-memory file only
  what is not one layer's share of a large stacked tensor (the header, small tensors, and every
  byte of a file that is not stacked).
- ``Layered.fill(i)`` fetches the frames that hold layer i's ranges, checks each frame's bytes
  against the digest ``scan`` took (so they are the bytes the manifest's hash covered) and writes
  them in; ``drop(i)`` punches them out again, returning the memory.

A blob written as one frame (by a gkbuild before frames) has nothing to fetch by part: ``scan``
returns None at its first frame and the caller holds the whole file as before.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import io
import os
import threading
from dataclasses import dataclass
from typing import BinaryIO, Callable

import zstandard

from ..checkpoint.safetensors_io import MAX_HEADER, Header, header_bytes, parse_header
from ..errors import GkError
from . import codec

MAX_FRAME = 64 << 20  # a frame that says it decodes to more is refused (a bomb, or not gkbuild's)
READ = 1 << 20  # bytes of the blob read at a time by ``scan``
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)


@dataclass(frozen=True)
class Frame:
    stored: int  # where its bytes start in the blob
    stored_len: int
    raw: int  # where its decoded bytes start in the file
    raw_len: int
    digest: bytes  # sha256 of its decoded bytes


def layer_spans(header: Header, layers: int, frame: int = codec.FRAME) -> list[list[tuple[int, int]]] | None:
    """Each layer's byte ranges [start, end) in a file whose every tensor is stacked on a leading
    axis of ``layers``, for the tensors whose one layer is at least ``frame`` bytes (smaller ones
    are kept whole); None for a file that is not stacked or has no such tensor."""
    ts = list(header.tensors.values())
    if not ts or any(not t.shape or t.shape[0] != layers for t in ts):
        return None
    big = sorted((t for t in ts if t.nbytes // layers >= frame), key=lambda t: t.offset)
    if not big:
        return None
    return [[(t.offset + i * (t.nbytes // layers), t.offset + (i + 1) * (t.nbytes // layers)) for t in big]
            for i in range(layers)]


class _Sink:
    """Where ``scan`` puts decoded bytes: at their offset in ``fd``, except those in ``lazy``
    (sorted, disjoint ranges, set once the header has been read)."""

    def __init__(self, fd: int):
        self.fd, self.pos, self.lazy, self._k = fd, 0, [], 0

    def write(self, data: memoryview) -> None:
        start, end = self.pos, self.pos + len(data)
        at = start
        while at < end:
            while self._k < len(self.lazy) and self.lazy[self._k][1] <= at:
                self._k += 1
            lo, hi = self.lazy[self._k] if self._k < len(self.lazy) else (end, end)
            if at < lo:  # kept bytes up to the next lazy range
                stop = min(lo, end)
                os.pwrite(self.fd, data[at - start:stop - start], at)
                at = stop
            else:  # inside a lazy range: skipped
                at = min(hi, end)
        self.pos = end


def _zstd_frames(src: BinaryIO, where: str):
    """(stored offset, stored length, decoded bytes) of each frame of a zstd stream, each frame's
    declared size checked before it is decoded; None first if its first frame holds more than
    ``codec.FRAME`` (or does not say: a blob written as one frame, before frames, so nothing to fetch by part)."""
    pending, base, first = b"", 0, True
    while True:
        while len(pending) < 18 and (more := src.read(READ)):  # a frame header is at most 18 bytes
            pending += more
        if not pending:
            return
        try:
            declared = zstandard.get_frame_parameters(pending).content_size
        except zstandard.ZstdError as e:
            raise GkError(f"{where}: corrupt zstd data ({e})") from None
        if first and not 0 <= declared <= codec.FRAME:  # one frame of the whole file: written before frames
            yield None
            return
        if not 0 <= declared <= MAX_FRAME:
            raise GkError(f"{where}: a zstd frame declares {declared} bytes; gkbuild's are at most {MAX_FRAME}")
        first = False
        d, out, used = zstandard.ZstdDecompressor().decompressobj(), [], 0
        while True:
            try:
                out.append(d.decompress(pending))
            except zstandard.ZstdError as e:
                raise GkError(f"{where}: corrupt zstd data ({e})") from None
            if sum(map(len, out)) > declared:
                raise GkError(f"{where}: a zstd frame decodes to more than the {declared} bytes it declares")
            if d.eof:
                used += len(pending) - len(d.unused_data)
                pending = d.unused_data
                break
            used += len(pending)
            pending = src.read(READ)
            if not pending:
                raise GkError(f"{where}: the blob ends inside a zstd frame")
        data = b"".join(out)
        if len(data) != declared:
            raise GkError(f"{where}: a zstd frame decodes to {len(data)} bytes, not the {declared} it declares")
        yield base, used, data
        base += used


def _raw_frames(src: BinaryIO):
    """(offset, length, bytes) of each ``codec.FRAME`` piece of a raw blob."""
    base = 0
    while data := src.read(codec.FRAME):
        yield base, len(data), data
        base += len(data)


def scan(src: BinaryIO, encoding: str, size: int, stored_size: int, where: str, fd: int,
         layers: int) -> tuple[str, list[Frame], list | None] | None:
    """Read the blob ``src`` once (see the module's docstring): (sha256 of the file, its frames,
    ``layer_spans`` of it or None), or None for a blob of one large frame (nothing written then)."""
    counted = codec._Counted(src, stored_size, where)
    frames_of = _zstd_frames(counted, where) if encoding == codec.ZSTD else _raw_frames(counted)
    h, frames, sink, head, spans = hashlib.sha256(), [], _Sink(fd), bytearray(), None
    for item in frames_of:
        if item is None:
            return None
        stored, stored_len, data = item
        if sink.pos + len(data) > size:
            raise GkError(f"{where}: decodes to more than the {size} bytes the manifest declares; refused")
        if spans is None:  # the header first: it says which ranges are layers'
            head += data
            n = int.from_bytes(head[:8], "little") if len(head) >= 8 else None
            if n is not None and (n > min(size - 8, MAX_HEADER) or len(head) >= 8 + n):
                header = parse_header(header_bytes(io.BytesIO(bytes(head)), size, where), size, where)
                spans, head = layer_spans(header, layers) or [], None
                sink.lazy = _union(spans)
        h.update(data)
        frames.append(Frame(stored, stored_len, sink.pos, len(data), hashlib.sha256(data).digest()))
        sink.write(memoryview(data))
    if sink.pos != size:
        raise GkError(f"{where}: decodes to {sink.pos} bytes, the manifest declares {size}")
    return h.hexdigest(), frames, spans or None


def _union(spans: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for layer in spans for r in layer):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class Layered:
    """A file held in the memfd ``fd`` with its layers' large ranges filled on demand (``fill``)
    from its blob by ``read(offset, n)`` (exact bytes of the blob) and punched out (``drop``)."""

    def __init__(self, fd: int, frames: list[Frame], spans: list, encoding: str, read: Callable[[int, int], bytes],
                 where: str):
        self.fd, self.frames, self.spans, self.encoding, self._read = fd, frames, spans, encoding, read
        self.where = where
        self._starts = [f.raw for f in frames]
        self._filled: set[int] = set()
        self._lock = threading.Lock()
        self.fetched = 0  # bytes read from the blob for layers

    def fill(self, i: int) -> None:
        with self._lock:
            if i in self._filled:
                return
            for run in self._runs(i):
                first, last = run[0], run[-1]
                blob = self._read(first.stored, last.stored + last.stored_len - first.stored)
                self.fetched += len(blob)
                for f in run:
                    part = blob[f.stored - first.stored:f.stored - first.stored + f.stored_len]
                    raw = memoryview(self._decoded(f, part))
                    for lo, hi in self.spans[i]:  # only the layer's bytes: the rest of a frame is held or not ours
                        a, b = max(lo, f.raw), min(hi, f.raw + f.raw_len)
                        if a < b:
                            os.pwrite(self.fd, raw[a - f.raw:b - f.raw], a)
            self._filled.add(i)

    def drop(self, i: int) -> None:
        """Punch layer i's ranges out (a page a range ends inside stays, zeroed there)."""
        with self._lock:
            if i not in self._filled:
                return
            for lo, hi in self.spans[i]:
                _punch(self.fd, lo, hi - lo)
            self._filled.discard(i)

    def _runs(self, i: int) -> list[list[Frame]]:
        """The frames holding layer i's ranges, in runs adjacent in the blob (one read a run)."""
        need: list[Frame] = []
        for lo, hi in self.spans[i]:
            k = bisect.bisect_right(self._starts, lo) - 1
            while k < len(self.frames) and self.frames[k].raw < hi:
                if not need or need[-1] is not self.frames[k]:
                    need.append(self.frames[k])
                k += 1
        runs: list[list[Frame]] = []
        for f in need:
            if runs and runs[-1][-1].stored + runs[-1][-1].stored_len == f.stored:
                runs[-1].append(f)
            else:
                runs.append([f])
        return runs

    def _decoded(self, f: Frame, part: bytes) -> bytes:
        try:
            raw = (zstandard.ZstdDecompressor().decompress(part, max_output_size=f.raw_len)
                   if self.encoding == codec.ZSTD else part)
        except zstandard.ZstdError as e:
            raise GkError(f"{self.where}: refused: corrupt zstd data at byte {f.stored} of the blob ({e}): it changed "
                          f"since the verify hashed it") from None
        if len(raw) != f.raw_len or hashlib.sha256(raw).digest() != f.digest:
            raise GkError(f"{self.where}: refused: bytes {f.raw}-{f.raw + f.raw_len} are not those hashed against the "
                          f"manifest (the blob changed during the verify)")
        return raw


def _punch(fd: int, offset: int, n: int) -> None:
    """Return the memory of bytes [offset, offset + n) of the memfd ``fd`` (they read as zeros)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, _PUNCH, offset, n) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
