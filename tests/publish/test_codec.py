"""The per-file encoding choice and the bounded streaming decoder."""

import io
import os

import pytest
import zstandard

from gkbuild.errors import GkError
from gkbuild.publish import codec


def test_random_bytes_stay_raw_and_structured_bytes_compress(tmp_path):
    noise, zeros = tmp_path / "noise", tmp_path / "zeros"
    noise.write_bytes(os.urandom(3 << 20))
    zeros.write_bytes(bytes(3 << 20))
    assert codec.choose(noise)[0] == codec.RAW
    enc, ratio = codec.choose(zeros)
    assert enc == codec.ZSTD and ratio < 0.01
    assert codec.choose(tmp_path / "zeros")[0] == codec.ZSTD
    (tmp_path / "empty").write_bytes(b"")
    assert codec.choose(tmp_path / "empty")[0] == codec.RAW


@pytest.mark.parametrize("encoding", [codec.ZSTD, codec.RAW])
def test_round_trip_hashes_both_ways(encoding):
    data = os.urandom(1 << 20) + bytes(5 << 20)
    stored = io.BytesIO()
    sha, n = codec.encode(io.BytesIO(data), stored, encoding)
    assert n == len(stored.getvalue()) and (n < len(data)) == (encoding == codec.ZSTD)
    out = io.BytesIO()
    assert codec.decode(io.BytesIO(stored.getvalue()), out, encoding, len(data), n, "x") == sha
    assert out.getvalue() == data


def test_a_zstd_bomb_is_stopped_at_the_declared_size():
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))  # 64 MiB of zeros in a few KiB
    out = io.BytesIO()
    with pytest.raises(GkError, match="more than the 1048576 bytes"):
        codec.decode(io.BytesIO(bomb), out, codec.ZSTD, 1 << 20, len(bomb), "blob")
    assert len(out.getvalue()) <= (1 << 20) + codec.CHUNK


def test_short_truncated_and_oversized_streams_are_refused():
    data = os.urandom(100_000)
    z = zstandard.ZstdCompressor().compress(data)
    with pytest.raises(GkError, match="decodes to 100000 bytes, the manifest declares 100001"):
        codec.decode(io.BytesIO(z), io.BytesIO(), codec.ZSTD, 100_001, len(z), "b")
    with pytest.raises(GkError):
        codec.decode(io.BytesIO(z[: len(z) // 2]), io.BytesIO(), codec.ZSTD, 100_000, len(z), "b")
    with pytest.raises(GkError, match="more than the 10 bytes its index declares"):
        codec.decode(io.BytesIO(data), io.BytesIO(), codec.RAW, 100_000, 10, "b")
    with pytest.raises(GkError, match="corrupt zstd|not a zstd"):
        codec.decode(io.BytesIO(b"not zstd at all" * 10), io.BytesIO(), codec.ZSTD, 150, 150, "b")
