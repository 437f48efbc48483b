"""Run a command and report its wall time and peak RSS (of that process tree's largest member);
the benches' scratch folder (``scratch``, ``dir_arg``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MARK = ".gkbench-scratch"  # written by ``scratch`` in each folder it makes: only such a folder is emptied


def dir_arg(ap, default: str) -> None:
    """The benches' ``--dir``: their scratch folder (see ``scratch``)."""
    ap.add_argument("--dir", default=default,
                    help=f"scratch folder for the bench's files (default {default}); one that exists and is not "
                         f"empty is used only if a bench made it (it carries {MARK}), else refused, never emptied")


@contextlib.contextmanager
def scratch(path, cache: str | None = "cache", resume: bool = False, remove: bool = True):
    """The folder ``path``, fresh, for a bench's files; GKBUILD_CACHE set to ``path/cache`` (``cache``
    names another sub-folder; None leaves the environment alone).

    No file the bench did not write is deleted: a path that exists and is not an empty folder or one
    that carries ``MARK`` (which only this helper writes) is refused: one line, exit status 1.
    A marked folder is emptied first (kept as it is with ``resume``). At the end (not after an error,
    so a failed run's files can be looked at or resumed) the folder is removed if it is ours: made
    now or marked by an earlier run; an empty folder the user made is emptied, and left. ``remove=False``
    keeps it all."""
    d = Path(path).expanduser()
    ours = not os.path.lexists(d)
    if not ours:
        if d.is_symlink() or not d.is_dir():
            sys.exit(f"bench: --dir {d}: not a folder (or a symbolic link); pass a new or empty folder")
        ours = (d / MARK).is_file()
        if not ours and any(d.iterdir()):
            sys.exit(f"bench: --dir {d}: not empty and not made by a bench (no {MARK}); refusing to touch it: "
                     f"pass a new or empty folder")
        if ours and not resume:
            for p in d.iterdir():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    d.mkdir(parents=True, exist_ok=True)
    (d / MARK).write_text("made by a gkbuild bench: it empties and removes this folder\n")
    if cache is not None:
        os.environ["GKBUILD_CACHE"] = str(d / cache)
    yield d
    if not remove:
        return
    if ours:
        shutil.rmtree(d, ignore_errors=True)
    else:  # the user's empty folder: everything in it is the bench's
        for p in d.iterdir():
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def run(cmd: list[str], **kw) -> tuple[float, int]:
    """(seconds, peak RSS bytes of the largest process in the tree). ``sync`` before, so no earlier
    dirty pages are flushed on our clock."""
    return run_tree(cmd, **kw)[:2]


def run_tree(cmd: list[str], **kw) -> tuple[float, int, int]:
    """(seconds, peak RSS of the largest process, peak RSS of the whole tree summed, sampled
    every 50 ms)."""
    m = measure(cmd, **kw)
    return m["wall"], m["rss"], m["rss_tree"]


def run_cpu(cmd: list[str], **kw) -> dict:
    """{wall, cpu (user + system seconds of the child and its children), rss (peak, largest
    process), load (the 1-minute load average before and after)}. ``sync`` first."""
    m = measure(cmd, **kw)
    return {k: m[k] for k in ("wall", "cpu", "rss", "load")}


def measure(cmd: list[str], **kw) -> dict:
    """Run ``cmd`` (after a ``sync``: no earlier dirty pages on its clock) and return {wall, cpu
    (user + system of it and its children), rss (peak of its largest process), rss_tree (peak of
    its tree summed, sampled every 50 ms), read_bytes (what its processes read from storage, page
    cache misses and mapped-page faults included: each process's /proc io as last sampled), load
    (the 1-minute load average before and after)}. A failing command ends the bench."""
    import threading

    import psutil

    os.sync()
    before = os.getloadavg()[0]
    t = time.perf_counter()
    p = subprocess.Popen(cmd, **kw)
    peak_tree, reads = 0, {}
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
                for q in procs:
                    with contextlib.suppress(psutil.Error):
                        reads[q.pid] = q.io_counters().read_bytes
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
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024,
            "rss_tree": peak_tree, "read_bytes": sum(reads.values()), "load": (before, os.getloadavg()[0])}


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
    """The gpt-oss-120b trn3 recipe on synth://gpt-oss-120b?layers=N, built with --no-compile into
    ``d/build`` in ``d``, a fresh ``scratch`` folder (GKBUILD_CACHE set to ``d/cache``), the synthesized
    checkpoint removed after; returns (build folder, bytes of the build)."""
    d = Path(d)
    build = d / "build"
    from gkbuild.checkpoint.source import parse, synth_cache_dir

    run([gk, "synth", "gpt-oss-120b", "--layers", str(layers), "-q", "--out",
         str(synth_cache_dir(parse(f"synth://gpt-oss-120b?layers={layers}")))])
    run([gk, "compile", str(Path(root) / "recipes" / "gpt-oss-120b-trn3.yaml"), "--out", str(build), "-q",
         "--no-compile", "--set", f"source=synth://gpt-oss-120b?layers={layers}"])
    shutil.rmtree(d / "cache" / "synth")  # only the build is needed from here on
    return build, sum(p.stat().st_size for p in build.rglob("*") if p.is_file() and ".gkbuild" not in p.parts)
