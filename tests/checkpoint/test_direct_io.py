"""Direct-I/O appends (what shard files are written with) and the safetensors stream on top."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os

import numpy as np
import pytest

from gkbuild.checkpoint import direct_io
from gkbuild.checkpoint.safetensors_io import MappedFile, SafetensorsStream, TensorSpec, read_header
from gkbuild.errors import GkError

STAGE = direct_io.STAGE


def _append(path, pieces: list[bytes]) -> bool:
    fd, direct = direct_io.open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    out = direct_io.DirectAppender(fd, direct)
    for p in pieces:
        out.put(memoryview(p))
    out.finish(sum(map(len, pieces)))
    os.close(fd)
    return out.direct


@pytest.mark.parametrize("sizes", [[], [1], [direct_io.BLOCK - 1], [STAGE], [STAGE + 1],
                                   [3, STAGE - 3, 2 * STAGE + 4097, 5]])
def test_appends_land_byte_for_byte_at_any_size(tmp_path, sizes):
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    p = tmp_path / "f"
    assert _append(p, pieces) is True  # ext4 takes O_DIRECT: the fast path is the one tested
    assert p.read_bytes() == b"".join(pieces)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm (tmpfs) on this host")
def test_tmpfs_gets_the_same_bytes_with_or_without_direct_io(tmp_path):
    data = os.urandom(STAGE + 12345)
    p = f"/dev/shm/gkbuild-direct-{os.getpid()}"
    try:
        _append(p, [data])
        assert open(p, "rb").read() == data
    finally:
        os.unlink(p)


def test_a_filesystem_that_refuses_our_alignment_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """Some filesystems open O_DIRECT but refuse writes at our alignment with EINVAL: the appender
    drops O_DIRECT on the descriptor and writes the same bytes buffered."""
    real = os.pwrite

    def picky(fd, buf, pos):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, pos)

    monkeypatch.setattr(direct_io.os, "pwrite", picky)
    data = os.urandom(2 * STAGE + 77)
    p = tmp_path / "f"
    assert _append(p, [data[:100], data[100:]]) is False
    assert p.read_bytes() == data


def test_a_forked_child_never_stages_in_its_parents_buffers(tmp_path):
    """A process that has written a stream holds free staging buffers; a worker forked from it
    (the build's pool) must not write through them while the parent does."""
    _append(tmp_path / "first", [b"x"])
    assert direct_io._free
    rng = np.random.default_rng(7)
    mine, theirs = (rng.integers(0, 256, 6 * STAGE, dtype=np.uint8).tobytes() for _ in range(2))
    pieces = lambda b: [b[i:i + (1 << 20)] for i in range(0, len(b), 1 << 20)]  # noqa: E731
    pid = os.fork()
    if pid == 0:
        try:
            _append(tmp_path / "child", pieces(theirs))
        finally:
            os._exit(0)
    _append(tmp_path / "parent", pieces(mine))
    os.waitpid(pid, 0)
    assert (tmp_path / "parent").read_bytes() == mine
    assert (tmp_path / "child").read_bytes() == theirs


def test_direct_io_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("GKBUILD_DIRECT_IO", "0")
    data = os.urandom(STAGE + 5)
    assert _append(tmp_path / "f", [data]) is False
    assert (tmp_path / "f").read_bytes() == data


def test_a_failed_write_is_raised_not_swallowed(tmp_path, monkeypatch):
    def broken(fd, buf, pos):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io.os, "pwrite", broken)
    with pytest.raises(OSError, match="No space"):
        _append(tmp_path / "f", [os.urandom(STAGE + 1)])


def _specs():
    return [TensorSpec("a", "fp32", (3, 5)), TensorSpec("b", "u8", (STAGE + 3,)), TensorSpec("c", "u16", (7,))]


def test_a_stream_is_a_valid_safetensors_file_with_the_hash_of_its_bytes(tmp_path):
    rng = np.random.default_rng(0)
    data = {"a": rng.standard_normal((3, 5), dtype=np.float32), "b": rng.integers(0, 256, STAGE + 3, dtype=np.uint8),
            "c": np.arange(7, dtype=np.uint16)}
    p = tmp_path / "s.safetensors"
    with SafetensorsStream(p, _specs(), {"k": "v"}) as w:
        for name in w.order:
            arr = data[name].reshape(-1)
            for lo in range(0, arr.size, 1000003):  # chunks that straddle the staging buffers
                w.append(name, arr[lo:lo + 1000003])
    assert w.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    h = read_header(p)
    assert h.metadata["k"] == "v"
    m = MappedFile(h)
    for name, want in data.items():
        np.testing.assert_array_equal(m.array(h.tensors[name]), want)
    m.close()
    assert [q.name for q in tmp_path.iterdir()] == ["s.safetensors"]


def test_a_stream_refuses_positional_and_out_of_order_writes_and_leaves_nothing(tmp_path):
    p = tmp_path / "s.safetensors"
    with pytest.raises(GkError, match="front to back"):
        with SafetensorsStream(p, _specs()) as w:
            w.write("a", np.zeros((3, 5), np.float32))
    with pytest.raises(GkError, match="out of file order"):
        with SafetensorsStream(p, _specs()) as w:
            w.append(w.order[1], np.zeros(STAGE + 3, np.uint8))
    with pytest.raises(GkError, match="not fully written"):
        with SafetensorsStream(p, _specs()) as w:
            w.append(w.order[0], np.zeros((3, 5), np.float32))
    assert list(tmp_path.iterdir()) == []
