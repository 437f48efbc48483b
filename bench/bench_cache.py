"""`make demo` on a fresh clone, cold and with a warm shared compile cache (issue 14).

A fresh `git clone` of this repository's HEAD gets its own `make install` (outside the clock).
Cold: `make demo` with no cache and `--cache-push` into an S3 compile cache on a local moto server
(GKBUILD_COMPILE_CACHE / GKBUILD_COMPILE_CACHE_PUSH); warm: the build folder removed, `make demo`
again reading that cache. Reported: the compile stage's seconds (from the build table) and the
whole `make demo` (compile + `verify --engine compiled`).

    .venv/bin/python bench/bench_cache.py [--dir /tmp/gkbench-cache]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, scratch  # noqa: E402
from tests.s3server import MOTO, moto_server  # noqa: E402


def demo(clone: Path, env: dict) -> tuple[float, float]:
    """(seconds of `make demo`, seconds of its compile stage)."""
    t = time.perf_counter()
    out = subprocess.run(["make", "demo"], cwd=clone, env=env, capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - t
    row = re.search(r"compile\s*│\s*(\w+)\s*│\s*([\d.]+)", out)
    if not row:
        raise SystemExit(f"no compile row in:\n{out}")
    return wall, float(row.group(2))


def main() -> None:
    ap = argparse.ArgumentParser()
    dir_arg(ap, "/tmp/gkbench-cache")
    a = ap.parse_args()
    with scratch(a.dir, cache=None) as d:
        clone = d / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["make", "install"], cwd=clone, check=True, capture_output=True)
        env = dict(os.environ, GKBUILD_CACHE=str(d / "gkcache"), COLUMNS="200")
        with moto_server(server=MOTO) as url:  # moto's own, as its RESULTS rows were measured
            import boto3

            boto3.client("s3", endpoint_url=url).create_bucket(Bucket="gk-cache")
            env.update({k: v for k, v in os.environ.items() if k.startswith("AWS_")})
            env["GKBUILD_COMPILE_CACHE"] = "s3://gk-cache/demo"
            cold = demo(clone, dict(env, GKBUILD_COMPILE_CACHE_PUSH="1"))
            shutil.rmtree(clone / "artifacts" / "tiny-cpu")
            warm = demo(clone, env)
        print("| make demo on a fresh clone | compile stage | whole make demo |\n|---|---|---|")
        print(f"| cold (compiles, pushes to the cache) | {cold[1]:.2f} s | {cold[0]:.2f} s |")
        print(f"| warm cache (s3://, moto on 127.0.0.1) | {warm[1]:.2f} s | {warm[0]:.2f} s |")
        print(f"| ratio warm / cold | {warm[1] / cold[1]:.3f}x | {warm[0] / cold[0]:.3f}x |")


if __name__ == "__main__":
    main()
