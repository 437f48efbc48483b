"""Planning is cheap (issue 21): a no-op `gkbuild compile` (every stage cached) of the 120b-shaped
build as a whole process, against the bare interpreter in the same run, and what it imports.

The 120b trn2 recipe on synth://gpt-oss-120b?layers=2 is built once (its NEFF stage is skipped
without the Neuron SDK, as on any host without it); then `--repeat` no-op compiles are timed
alternating with `python -c pass`; medians. `python -X importtime` of one no-op names the slowest
imports, and the heavy libraries (torch, transformers, s3fs, ml_dtypes, jsonschema) must be absent.

    .venv/bin/python bench/bench_noop.py [--layers 2] [--repeat 7] [--dir /tmp/gkbench-noop]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import median, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = str(Path(sys.executable).with_name("gkbuild"))
HEAVY = ("torch", "transformers", "s3fs", "ml_dtypes", "jsonschema")


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dir", default="/tmp/gkbench-noop")
    a = ap.parse_args()
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    os.environ["GKBUILD_CACHE"] = str(d / "cache")
    run([GK, "synth", "gpt-oss-120b", "--layers", str(a.layers), "-q", "--out",
         str(d / "cache" / "synth" / f"gpt-oss-120b-L{a.layers}-s0-v1")])
    cmd = [GK, "compile", str(ROOT / "recipes" / "gpt-oss-120b-trn2.yaml"), "--out", str(d / "build"), "-q",
           "--set", f"source=synth://gpt-oss-120b?layers={a.layers}"]
    run(cmd)  # the build
    run(cmd)  # settles the state after the first build's warnings
    noop, bare = [], []
    for _ in range(a.repeat):
        noop.append(timed(cmd))
        bare.append(timed([sys.executable, "-c", "pass"]))
    load = os.getloadavg()
    imp = subprocess.run([sys.executable, "-X", "importtime", "-m", "gkbuild", *cmd[1:]], capture_output=True,
                         text=True).stderr
    rows = [(int(m.group(2)), m.group(3).strip()) for m in re.finditer(r"import time:\s+(\d+) \|\s+(\d+) \|(.*)", imp)]
    top = sorted((r for r in rows if not r[1].startswith(" ")), reverse=True)[:6]
    heavy = sorted({name.strip().split(".")[0] for _, name in rows} & set(HEAVY))
    print(f"| no-op compile, 120b-shaped ({a.layers} layers, 128 ranks) | {median(noop):.3f} s |")
    print(f"| bare interpreter (`python -c pass`) | {median(bare):.3f} s |")
    print(f"| gkbuild's own share | {median(noop) - median(bare):.3f} s |")
    print(f"\nload average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)")
    print("slowest top-level imports (cumulative):", ", ".join(f"{n} {us / 1e3:.0f} ms" for us, n in top))
    print(f"heavy libraries imported: {heavy or 'none'}")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
