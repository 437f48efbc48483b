"""gkbuild synth gpt-oss-120b --layers 2 against `cp -r` of its output, in one run.

Synth and cp alternate ``--repeat`` times; medians are reported, peak RSS is the max.

    .venv/bin/python bench/bench_synth.py [--layers 2] [--dir /tmp/gkbench]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import cp_then_sync, dir_arg, gib, median, run, scratch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    dir_arg(ap, "/tmp/gkbench")
    ap.add_argument("--repeat", type=int, default=3, help="alternate runs, report medians (the disk is noisy)")
    a = ap.parse_args()
    with scratch(a.dir, cache=None) as d:
        src = d / "synth"
        gk = str(Path(sys.executable).with_name("gkbuild"))
        walls, cps, rss, cp_rss = [], [], 0, 0
        for _ in range(a.repeat):
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(d / "copy", ignore_errors=True)
            w, r = run([gk, "synth", "gpt-oss-120b", "--layers", str(a.layers), "--out", str(src), "-q"])
            c, cr = cp_then_sync(str(src), str(d / "copy"))
            walls.append(w)
            cps.append(c)
            rss, cp_rss = max(rss, r), max(cp_rss, cr)
        size = sum(p.stat().st_size for p in src.iterdir())
        wall, cp_wall = median(walls), median(cps)
        print(f"| synth gpt-oss-120b --layers {a.layers} | {gib(size)} | {wall:.2f} s | {cp_wall:.2f} s | "
              f"{wall / cp_wall:.2f}x | {gib(rss)} | {gib(cp_rss)} |")


if __name__ == "__main__":
    main()
