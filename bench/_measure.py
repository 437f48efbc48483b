"""Run a command and report its wall time and peak RSS (of that process tree's largest member)."""

from __future__ import annotations

import os
import subprocess
import time


def run(cmd: list[str], **kw) -> tuple[float, int]:
    """(seconds, peak RSS bytes). ``sync`` before, so no earlier dirty pages are flushed on our clock."""
    os.sync()
    t = time.perf_counter()
    p = subprocess.Popen(cmd, **kw)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed ({status})")
    return wall, usage.ru_maxrss * 1024


def cp_then_sync(src: str, dst: str) -> tuple[float, int]:
    """The baseline: copy the same bytes to the same disk, flushed (gkbuild fsyncs its outputs)."""
    return run(["sh", "-c", f'cp -r "{src}" "{dst}" && sync'])


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]
