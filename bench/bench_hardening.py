"""What the hardening of issue 11 costs, each ratio against a baseline measured in the same run.

(a) the bf16 finiteness check a build now runs on every bf16 source tensor it reads, against a
    plain copy of the same bytes (the least any consumer of the tensor does);
(b) Build.open + load_rank of a build with verify="hash" the first time on this host, then
    remembered, against verify="none".

    .venv/bin/python bench/bench_hardening.py [--gib 1] [--repeat 5] [--dir /tmp/gkbench-hard]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, scratch  # noqa: E402


def timed(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    dir_arg(ap, "/tmp/gkbench-hard")
    a = ap.parse_args()
    from gkbuild import recipe
    from gkbuild.checkpoint.reader import check_finite_bf16
    from gkbuild.pipeline.pipeline import compile_build
    from gkbuild.runtime import Build

    with scratch(a.dir) as work:  # refuses a foreign --dir before anything is measured
        n = int(a.gib * (1 << 30)) // 2
        bits = np.random.default_rng(0).integers(0, 0x7F00, n, dtype=np.uint16)  # finite bf16 patterns
        dst = np.empty_like(bits)
        copy = timed(lambda: np.copyto(dst, bits), a.repeat)
        check = timed(lambda: check_finite_bf16(bits, "bench"), a.repeat)
        print(f"(a) {a.gib:g} GiB bf16: copy {copy:.3f} s, finiteness check {check:.3f} s "
              f"({check / copy:.2f}x the copy)")

        out = work / "build"
        compile_build(recipe.load(ROOT / "recipes" / "tiny-cpu.yaml"), out=out, quiet=True, compile=False)

        def load(verify: str) -> None:
            b = Build.open(out, verify=verify)
            b.load_rank(0)
            b.close()

        none = timed(lambda: load("none"), a.repeat)
        (work / "cache" / "fingerprints.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        load("hash")
        first = time.perf_counter() - t0
        again = timed(lambda: load("hash"), a.repeat)
        size = timed(lambda: load("size"), a.repeat)
        mib = sum(f["size"] for f in Build.open(out, verify="none").manifest["files"]) / 2**20
        print(f"(b) tiny-cpu build ({mib:.0f} MiB): open+load_rank verify=none {none * 1e3:.1f} ms; "
              f"hash first {first * 1e3:.1f} ms ({first / none:.1f}x), remembered {again * 1e3:.1f} ms "
              f"({again / none:.2f}x), size {size * 1e3:.1f} ms ({size / none:.2f}x)")


if __name__ == "__main__":
    main()
