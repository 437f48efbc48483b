"""A stored shard read back a layer at a time (gkbuild.publish.frames): what is kept after one
scan, what a layer's fill brings back (the file's own bytes), what a drop returns, and every
blob that is not what was hashed refused in one line."""

from __future__ import annotations

import hashlib
import io
import os

import numpy as np
import pytest
import zstandard
from safetensors.numpy import save

from gkbuild.checkpoint.safetensors_io import header_bytes, parse_header
from gkbuild.errors import GkError
from gkbuild.publish import codec, frames

L = 3


def _shard() -> bytes:
    """A shard like a build's: every tensor stacked on a leading axis of L layers; one large
    (a layer is more than a frame), one small (a layer is a few bytes), one between."""
    rng = np.random.default_rng(0)
    return save({"big": rng.integers(0, 255, (L, 3, codec.FRAME // 2 + 7), dtype=np.uint8),
                 "mid": rng.standard_normal((L, codec.FRAME // 8 + 3)).astype(np.float32),
                 "small": rng.standard_normal((L, 5)).astype(np.float32)})


def _blob(data: bytes, encoding: str) -> bytes:
    out = io.BytesIO()
    codec.encode(io.BytesIO(data), out, encoding)
    return out.getvalue()


def _scan(data: bytes, blob: bytes, encoding: str):
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, len(data))
    got = frames.scan(io.BytesIO(blob), encoding, len(data), len(blob), "store/blob (weights/x)", fd, L)
    return fd, got


def _header(data: bytes):
    return parse_header(header_bytes(io.BytesIO(data), len(data), "x"), len(data), "x")


def _bytes(fd: int, n: int) -> bytes:
    return os.pread(fd, n, 0)


def _resident(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


@pytest.mark.parametrize("encoding", [codec.ZSTD, codec.RAW])
def test_a_scan_keeps_all_but_the_layers_large_ranges_and_a_fill_brings_back_the_files_own_bytes(encoding):
    data = _shard()
    blob = _blob(data, encoding)
    if encoding == codec.ZSTD:  # a run of frames, each of codec.FRAME bytes but the last
        assert len(list(frames._zstd_frames(io.BytesIO(blob), "b"))) == -(-len(data) // codec.FRAME)
    fd, (digest, table, spans) = _scan(data, blob, encoding)
    assert digest == hashlib.sha256(data).hexdigest()
    header = _header(data)
    big = header.tensors["big"]
    per = big.nbytes // L
    assert spans == [[(big.offset + i * per, big.offset + (i + 1) * per)] for i in range(L)]  # mid, small: kept
    held = _bytes(fd, len(data))
    lazy = np.zeros(len(data), bool)
    for lo, hi in (r for layer in spans for r in layer):
        lazy[lo:hi] = True
    mine, want = np.frombuffer(held, np.uint8), np.frombuffer(data, np.uint8)
    assert (mine[~lazy] == want[~lazy]).all() and not mine[lazy].any()
    before = _resident(fd)
    read = []
    lay = frames.Layered(fd, table, spans, encoding, lambda o, n: read.append((o, n)) or blob[o:o + n], "w")
    lay.fill(1)
    lo, hi = spans[1][0]
    assert _bytes(fd, len(data))[lo:hi] == data[lo:hi]
    assert len(read) == 1 and sum(n for _, n in read) <= (hi - lo) + 2 * len(blob) / len(table) + 4096
    assert _resident(fd) > before
    lay.fill(1)
    assert len(read) == 1  # a layer filled is not fetched again
    lay.drop(1)
    assert not any(_bytes(fd, len(data))[lo:hi]) and _resident(fd) <= before + 2 * 4096
    os.close(fd)


def test_a_blob_that_changes_after_its_scan_is_refused_when_a_layer_is_fetched():
    data = _shard()
    blob = _blob(data, codec.ZSTD)
    fd, (_, table, spans) = _scan(data, blob, codec.ZSTD)
    forged = bytearray(blob)  # the layer's frames re-made from other bytes, as a forger would
    f = next(f for f in table if f.raw <= spans[2][0][0] < f.raw + f.raw_len)
    other = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(f.raw_len))
    forged[f.stored:f.stored + f.stored_len] = other[:f.stored_len].ljust(f.stored_len, b"\0")
    lay = frames.Layered(fd, table, spans, codec.ZSTD, lambda o, n: bytes(forged[o:o + n]), "store/b (weights/x)")
    with pytest.raises(GkError) as e:
        lay.fill(2)
    assert str(e.value).startswith("store/b (weights/x): refused: ") and "\n" not in str(e.value)
    raw = frames.Layered(fd, table, spans, codec.RAW, lambda o, n: bytes(n), "store/b (weights/x)")
    raw.frames = [frames.Frame(x.raw, x.raw_len, x.raw, x.raw_len, x.digest) for x in table]
    with pytest.raises(GkError, match="are not those hashed against the manifest"):
        raw.fill(0)
    os.close(fd)


def test_a_blob_written_as_one_frame_is_held_whole_and_a_lying_frame_is_refused():
    data = _shard()
    whole = zstandard.ZstdCompressor(write_checksum=True).compress(data)  # a blob from before frames
    fd, got = _scan(data, whole, codec.ZSTD)
    assert got is None
    os.close(fd)
    framed = _blob(data, codec.ZSTD)
    bomb = framed + zstandard.ZstdCompressor().compress(bytes(codec.FRAME))  # decodes past the manifest's size
    with pytest.raises(GkError, match="decodes to more than"):
        _scan(data, bomb, codec.ZSTD)
    with pytest.raises(GkError, match="ends inside a zstd frame|decodes to"):
        _scan(data, framed[:-10], codec.ZSTD)
    short = _blob(data[:-1], codec.ZSTD)
    with pytest.raises(GkError, match="decodes to"):
        _scan(data, short, codec.ZSTD)


def test_a_file_that_is_not_stacked_has_no_layers():
    h = _header(save({"a": np.zeros((L, codec.FRAME), np.uint8), "b": np.zeros((4, 1), np.uint8)}))
    assert frames.layer_spans(h, L) is None  # b has no layer axis: the file is held whole
    h = _header(save({"a": np.zeros((L, 8), np.uint8)}))
    assert frames.layer_spans(h, L) is None  # no layer of it is as large as a frame
