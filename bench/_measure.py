"""Run a command and report its wall time and peak RSS (of that process tree's largest member)."""

from __future__ import annotations

import os
import subprocess
import time


def run(cmd: list[str], **kw) -> tuple[float, int]:
    """(seconds, peak RSS bytes of the largest process in the tree). ``sync`` before, so no earlier
    dirty pages are flushed on our clock."""
    return run_tree(cmd, **kw)[:2]


def run_tree(cmd: list[str], **kw) -> tuple[float, int, int]:
    """(seconds, peak RSS of the largest process, peak RSS of the whole tree summed, sampled
    every 50 ms)."""
    import threading

    import psutil

    os.sync()
    t = time.perf_counter()
    p = subprocess.Popen(cmd, **kw)
    peak_tree = 0
    stop = threading.Event()

    def sample():
        nonlocal peak_tree
        try:
            proc = psutil.Process(p.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            try:
                procs = [proc] + proc.children(recursive=True)
                peak_tree = max(peak_tree, sum(q.memory_info().rss for q in procs))
            except psutil.NoSuchProcess:
                pass
            stop.wait(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    stop.set()
    th.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed ({status})")
    return wall, usage.ru_maxrss * 1024, peak_tree


def run_cpu(cmd: list[str], **kw) -> dict:
    """{wall, cpu (user + system seconds of the child and its children), rss (peak, largest
    process), load (the 1-minute load average before and after)}. ``sync`` first."""
    os.sync()
    before = os.getloadavg()[0]
    t = time.perf_counter()
    p = subprocess.Popen(cmd, **kw)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed ({status})")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024,
            "load": (before, os.getloadavg()[0])}


def timed(cmd: list[str], **kw) -> tuple[float, float, str, int]:
    """(wall, CPU seconds of the process tree, stdout, peak RSS of its largest process in bytes),
    after a sync (no earlier dirty pages on our clock)."""
    os.sync()
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kw)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed")
    return wall, ru.ru_utime + ru.ru_stime, out, ru.ru_maxrss << 10


def cp_then_sync(src: str, dst: str) -> tuple[float, int]:
    """The baseline: copy the same bytes to the same disk, flushed (gkbuild fsyncs its outputs)."""
    return run(["sh", "-c", f'cp -r "{src}" "{dst}" && sync'])


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def build_120b(d, layers: int, gk: str, root) -> tuple:
    """The gpt-oss-120b trn2 recipe on synth://gpt-oss-120b?layers=N, built with --no-compile into
    ``d/build`` in a fresh folder ``d`` (GKBUILD_CACHE set to ``d/cache``), the synthesized
    checkpoint removed after; returns (build folder, bytes of the build)."""
    import shutil
    from pathlib import Path

    d = Path(d)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    os.environ["GKBUILD_CACHE"] = str(d / "cache")
    build = d / "build"
    from gkbuild.checkpoint.source import parse, synth_cache_dir

    run([gk, "synth", "gpt-oss-120b", "--layers", str(layers), "-q", "--out",
         str(synth_cache_dir(parse(f"synth://gpt-oss-120b?layers={layers}")))])
    run([gk, "compile", str(Path(root) / "recipes" / "gpt-oss-120b-trn2.yaml"), "--out", str(build), "-q",
         "--no-compile", "--set", f"source=synth://gpt-oss-120b?layers={layers}"])
    shutil.rmtree(d / "cache" / "synth")  # only the build is needed from here on
    return build, sum(p.stat().st_size for p in build.rglob("*") if p.is_file() and ".gkbuild" not in p.parts)
