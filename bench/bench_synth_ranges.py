"""Random 1 MiB ranges of ``synth://gpt-oss-120b`` read by range (``synth_ranged``, nothing on disk)
against the same ranges ``pread`` from the files ``gkbuild synth`` wrote, in one run.

Each case runs in its own process (its peak RSS is its own):
- ``range-36``: ``--count`` ranges drawn over the 36-layer checkpoint's weight files (61 GB);
- ``range-N`` and ``disk-N``: the same ``--count`` ranges of the ``--layers``-layer checkpoint (the
  baseline), generated, then read from the folder synthesized for it (just written: the page cache
  holds what it can, so ``disk`` is the fast case, a disk read would be slower);
and ``open-36`` times listing and validating the 36-layer headers (what a build's validate does).

    .venv/bin/python bench/bench_synth_ranges.py [--layers 2] [--count 64] [--dir /tmp/gkbench-ranges]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, scratch  # noqa: E402

MIB = 1 << 20
CHILD = r"""
import hashlib, json, os, resource, sys, time
import numpy as np
from gkbuild.checkpoint.ranged import RangedCheckpoint, connect
case, layers, count, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t0 = time.perf_counter()
remote = connect(f"synth://gpt-oss-120b?layers={layers}&seed=0")
if case == "open":
    ck = RangedCheckpoint.open_remote(remote)
    out = {"tensors": len(ck.where)}
else:
    files = sorted(n for n in remote.files() if n.endswith(".safetensors"))
    sizes = [remote.file(n).size for n in files]
    rng = np.random.default_rng(0)
    picks = []
    for at in rng.integers(0, sum(sizes) - (1 << 20), count).tolist():
        k = 0
        while at >= sizes[k]:
            at -= sizes[k]; k += 1
        picks.append((files[k], min(at, sizes[k] - (1 << 20))))
    from gkbuild.dtypes import dtype
    dtype("bf16").numpy  # ml_dtypes imported before the clock (0.5 s, once a process)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    digest, wall, cpu = hashlib.sha256(), 0.0, 0.0
    for name, at in picks:
        t, c = time.perf_counter(), time.process_time()
        if case == "range":
            data = remote.read(name, at, 1 << 20)
        else:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            data = os.pread(fd, 1 << 20, at)
            os.close(fd)
        wall, cpu = wall + time.perf_counter() - t, cpu + time.process_time() - c
        digest.update(data)  # outside the clock
    out = {"rss_before_reads": rss0, "digest": digest.hexdigest(), "wall": wall, "cpu": cpu}
out.setdefault("wall", time.perf_counter() - t0)
out.setdefault("cpu", time.process_time())
out.update(
           peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10, files=len(remote.files()),
           bytes=sum(f.size for f in remote.files().values()))
print(json.dumps(out))
"""


def child(case: str, layers: int, count: int, folder: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, case, str(layers), str(count), folder], capture_output=True,
                       text=True, cwd="/", env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)))
    if r.returncode:
        sys.exit(f"bench: {case}: {r.stderr.strip().splitlines()[-1]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2, help="the materialized baseline's layers")
    ap.add_argument("--count", type=int, default=64)
    dir_arg(ap, "/tmp/gkbench-ranges")
    a = ap.parse_args()
    with scratch(a.dir, cache=None) as d:
        rows = {"open-36": child("open", 36, 0, ""), "range-36": child("range", 36, a.count, "")}
        t0 = time.perf_counter()
        gk = str(Path(sys.executable).with_name("gkbuild"))
        subprocess.run([gk, "synth", "gpt-oss-120b", "--layers", str(a.layers), "--out", str(d / "ck"), "-q"],
                       check=True)
        synth_wall = time.perf_counter() - t0
        rows[f"range-{a.layers}"] = child("range", a.layers, a.count, "")
        rows[f"disk-{a.layers}"] = child("disk", a.layers, a.count, str(d / "ck"))
        if rows[f"range-{a.layers}"]["digest"] != rows[f"disk-{a.layers}"]["digest"]:
            sys.exit("bench: the ranges read by range differ from the synthesized files")
        base = rows[f"disk-{a.layers}"]["wall"]
        print(f"| case | checkpoint | reads | wall | per MiB | vs disk-{a.layers} | CPU | RSS before reads | peak RSS |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            reads = 0 if name.startswith("open") else a.count
            per, ratio, before = (f"{r['wall'] / reads * 1e3:.1f} ms", f"{r['wall'] / base:.1f}x",
                                  f"{r['rss_before_reads'] / 2**20:.0f} MiB") if reads else ("-", "-", "-")
            print(f"| {name} | {r['bytes'] / 2**30:.2f} GiB, {r['files']} files | {reads} x 1 MiB | "
                  f"{r['wall']:.3f} s | {per} | {ratio} | {r['cpu']:.2f} s | {before} | {r['peak_rss'] / 2**20:.0f} MiB |")
        print(f"(gkbuild synth gpt-oss-120b --layers {a.layers}, the baseline's files: {synth_wall:.1f} s; "
              f"every byte of the ranges (sha256) equal between range-{a.layers} and disk-{a.layers})")


if __name__ == "__main__":
    main()
