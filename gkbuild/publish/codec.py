"""How a published file is stored: zstd, or raw where compression does not pay.

MXFP4 expert tiles are close to random bits and do not compress; bf16 weights and metadata do.
The choice is made per file from a sample (a few slices spread through it), so a multi-GB shard
that would not shrink is never pushed through the compressor. A zstd blob is a run of
independent frames of ``FRAME`` bytes each (any zstd reader reads it as one stream), so a reader
can decode the part of a file it needs alone (``frames``).
"""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO, Callable

import zstandard

from ..errors import GkError
from ..jsonio import open_regular

ZSTD, RAW = "zstd", "raw"
EXT = {ZSTD: "zst", RAW: "raw"}
LEVEL = 1  # measured here: the same ratio as level 3 (within 0.3% on bf16 and MX shards) at 2x the speed
MIN_SAVING = 0.05  # compress when the sample shrinks by at least this fraction
SAMPLE = 256 << 10  # bytes per sampled slice
SLICES = 4  # 1 MiB a file: ~3% of an expert shard, a sample that costs little next to the file
CHUNK = 8 << 20
FRAME = 256 << 10  # the bytes a zstd frame holds: what a verify in place fetches at least (``frames``)

Advance = Callable[[int], None]


def choose(path: os.PathLike, level: int = LEVEL) -> tuple[str, float]:
    """(encoding, sampled ratio stored/raw) for the file at ``path``."""
    size = os.path.getsize(path)
    if size == 0:
        return RAW, 1.0
    step = max(SAMPLE, size // SLICES)
    cctx = zstandard.ZstdCompressor(level=level)
    raw = packed = 0
    with open_regular(path) as f:
        for off in range(0, size, step):
            f.seek(off)
            block = f.read(SAMPLE)
            raw += len(block)
            packed += len(cctx.compress(block))
    ratio = packed / raw
    return (ZSTD if ratio <= 1 - MIN_SAVING else RAW), ratio


def encode(src: BinaryIO, dst: BinaryIO, encoding: str, level: int = LEVEL, threads: int = 0,
           advance: Advance = lambda n: None) -> tuple[str, int]:
    """Stream ``src`` into ``dst`` in ``encoding``; returns (sha256 of the source bytes, stored size).
    The source hash is what the caller checks against the manifest: a build file that rotted on
    disk since it was built is caught before it is published."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    start = dst.tell()
    if encoding == ZSTD:
        # independent frames of FRAME bytes each (``frames``: a verify in place fetches and checks
        # only the frames a layer needs), each carrying its size and a checksum
        cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
        frame = bytearray(FRAME)
        while n := _fill(src, frame):
            h.update(memoryview(frame)[:n])
            dst.write(cctx.compress(memoryview(frame)[:n]))
            advance(n)
    else:
        while n := src.readinto(buf):
            h.update(view[:n])
            dst.write(view[:n])
            advance(n)
    return h.hexdigest(), dst.tell() - start


def _fill(src: BinaryIO, buf: bytearray) -> int:
    """Read ``src`` into ``buf`` until it is full or ``src`` ends; how many bytes."""
    view, n = memoryview(buf), 0
    while n < len(buf) and (got := src.readinto(view[n:])):
        n += got
    return n


class _Counted:
    """A reader that refuses to deliver more than ``limit`` bytes of stored data."""

    def __init__(self, f: BinaryIO, limit: int, where: str):
        self.f, self.limit, self.where, self.n = f, limit, where, 0

    def _count(self, n: int) -> int:
        self.n += n
        if self.n > self.limit:
            raise GkError(f"{self.where}: the store holds more than the {self.limit} bytes its index declares")
        return n

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        self._count(len(b))
        return b

    def readinto(self, buf) -> int:
        return self._count(self.f.readinto(buf) or 0)


def decode(src: BinaryIO, dst: BinaryIO, encoding: str, size: int, stored_size: int, where: str,
           advance: Advance = lambda n: None) -> str:
    """Stream stored bytes into ``dst``, refusing to write past ``size`` (a zstd bomb, or a file that
    is not what the manifest says) or to read past ``stored_size``; returns the sha256 written.
    One reused buffer: a fresh multi-MB ``bytes`` a chunk costs page faults (measured: a third of
    a fetch's time in the kernel)."""
    h = hashlib.sha256()
    counted = _Counted(src, stored_size, where)
    reader = (zstandard.ZstdDecompressor().stream_reader(counted, read_size=1 << 20, closefd=False,
                                                         read_across_frames=True)
              if encoding == ZSTD else counted)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    written = 0
    while True:
        try:
            n = reader.readinto(buf)
        except zstandard.ZstdError as e:
            raise GkError(f"{where}: corrupt zstd data ({e})") from None
        if not n:
            break
        written += n
        if written > size:
            raise GkError(f"{where}: decodes to more than the {size} bytes the manifest declares; refused")
        h.update(view[:n])
        dst.write(view[:n])
        advance(n)
    if written != size:
        raise GkError(f"{where}: decodes to {written} bytes, the manifest declares {size}")
    return h.hexdigest()
