"""Sequential file writes that bypass the page cache (``O_DIRECT``), double-buffered.

Why: a build writes tens of GB once and does not read them back. Through the page cache every
byte is copied into a freshly allocated cache page; on the VMs we build on that copy cost 1.2-3 s
of system time per GiB (new guest pages fault in at the hypervisor), more CPU than the whole
relayout, and it evicts the checkpoint the build is reading. Direct writes DMA from our own
buffers: ~0.05 s of system time per GiB, at disk speed. The data is on the device when a write
returns; the file's size and extents are durable after the caller's fsync/syncfs, as before.

Direct I/O wants the buffer address, the file offset and the length aligned to the device's
logical block. Bytes are gathered in page-aligned staging buffers and written in whole buffers;
the last, partial one is rounded up to a block and the file truncated back to its size. One
background thread writes a full buffer while the caller fills the other. Where the filesystem
refuses direct I/O (tmpfs, some FUSE mounts, an unusual block size), the same writes go through
the page cache instead: slower, never wrong.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import naming

BLOCK = 4096  # a multiple of every logical block size Linux devices use for direct I/O
STAGE = 8 << 20  # per staging buffer: large enough for full-speed device writes, small in memory


def open_direct(path, flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """os.open with O_DIRECT where the filesystem takes it; (fd, direct?). ``GKBUILD_DIRECT_IO=0``
    turns it off (a network filesystem that does direct I/O as one synchronous RPC a write)."""
    if hasattr(os, "O_DIRECT") and os.environ.get("GKBUILD_DIRECT_IO", "1") != "0":
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


_free: list[mmap.mmap] = []  # staging buffers of finished appenders: a worker writes hundreds of
# files, and fresh buffers would have every page faulted in and zeroed again for each
# A forked child starts with none of its parent's: two processes must never stage in one buffer.
os.register_at_fork(after_in_child=_free.clear)


def _take() -> mmap.mmap:
    """A free staging buffer, or a new one: anonymous and private (Python's default anonymous map is
    shared, which a fork would share with the child), page-aligned as direct I/O wants."""
    if _free:
        return _free.pop()
    return mmap.mmap(-1, STAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def pwrite_all(fd: int, buf: memoryview, pos: int, name: str) -> None:
    """Write all of ``buf`` at ``pos``; a failure (a full disk) raised naming the file ``name``, as a
    write's own OSError names none."""
    with naming(name):
        while len(buf):
            n = os.pwrite(fd, buf, pos)
            buf, pos = buf[n:], pos + n


class DirectAppender:
    """Append bytes to ``fd`` from file offset 0; ``finish(size)`` writes the rest and sets the size."""

    def __init__(self, fd: int, direct: bool, name: str = ""):
        self.fd = fd
        self.direct = direct
        self.name = name  # the file an error names (a failed write's OSError carries none)
        self._bufs = [_take(), _take()]
        self._cur = 0
        self._fill = 0  # bytes staged in the current buffer
        self._pos = 0  # file offset of the current buffer (a multiple of STAGE)
        self._pending: list[Future | None] = [None, None]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gkbuild-direct")

    def put(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            n = min(len(data), STAGE - self._fill)
            self._bufs[self._cur][self._fill:self._fill + n] = data[:n]
            self._fill += n
            data = data[n:]
            if self._fill == STAGE:
                self._flush(STAGE)

    def _flush(self, length: int) -> None:
        """Hand the current buffer (``length`` bytes, block-aligned) to the writer; take the other."""
        i = self._cur
        self._pending[i] = self._pool.submit(self._write, i, length, self._pos)
        self._cur = 1 - i
        self._pos += self._fill
        self._fill = 0
        self._wait(self._cur)  # the buffer we fill next must have been written out

    def _wait(self, i: int) -> None:
        f, self._pending[i] = self._pending[i], None
        if f is not None:
            f.result()

    def _write(self, i: int, length: int, pos: int) -> None:
        buf = memoryview(self._bufs[i])[:length]
        try:
            pwrite_all(self.fd, buf, pos, self.name)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            # The filesystem took O_DIRECT at open but not these writes: through the page cache.
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            pwrite_all(self.fd, buf, pos, self.name)
        finally:
            buf.release()

    def finish(self, size: int) -> None:
        """Write what is staged, wait for every write, and make the file exactly ``size`` bytes."""
        try:
            if self._fill:
                tail = self._fill
                padded = -(-tail // BLOCK) * BLOCK
                self._bufs[self._cur][tail:padded] = bytes(padded - tail)
                self._fill = padded
                self._flush(padded)
            for i in (0, 1):
                self._wait(i)
        finally:
            self.close()
        os.ftruncate(self.fd, size)

    def close(self) -> None:
        """Let the writes in flight end (their errors are the caller's to have seen) and free the buffers."""
        self._pool.shutdown(wait=True)
        _free.extend(self._bufs)
        self._bufs = []
