"""gkbuild publish + fetch through S3 (a moto server on 127.0.0.1) against the folder store, in the
same run, on the 2-layer 120b-shaped build (issue 14).

The gpt-oss-120b trn2 recipe on synth://gpt-oss-120b?layers=N is built once with --no-compile
(outside the clock); then --repeat alternating rounds of: publish to a fresh folder store, fetch
it into a fresh folder, publish to a fresh S3 prefix, fetch that. Medians; peak RSS of the
gkbuild process (the server's own memory is not counted: on AWS it is not ours); a no-op
republish to S3; an interrupted S3 publish resumed.

    .venv/bin/python bench/bench_s3.py [--layers 2] [--repeat 3] [--dir /tmp/gkbench-s3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from _measure import build_120b, dir_arg, gib, median, run, scratch  # noqa: E402
from tests.s3server import MOTO, moto_server  # noqa: E402

GK = str(Path(sys.executable).with_name("gkbuild"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    dir_arg(ap, "/tmp/gkbench-s3")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        build, size = build_120b(d, a.layers, GK, ROOT)
        t = {k: [] for k in ("pub_dir", "fetch_dir", "pub_s3", "fetch_s3")}
        rss = dict.fromkeys(t, 0)
        with moto_server(server=MOTO) as url:  # moto's own, as its RESULTS rows were measured
            import boto3
            import s3fs

            boto3.client("s3", endpoint_url=url).create_bucket(Bucket="gkbench")
            for i in range(a.repeat):
                for p in ("store", "got", "got-s3"):
                    shutil.rmtree(d / p, ignore_errors=True)
                steps = {"pub_dir": [GK, "publish", str(build), "--to", str(d / "store"), "-q"],
                         "fetch_dir": [GK, "fetch", str(d / "store"), "--to", str(d / "got"), "-q"],
                         "pub_s3": [GK, "publish", str(build), "--to", f"s3://gkbench/r{i}", "-q"],
                         "fetch_s3": [GK, "fetch", f"s3://gkbench/r{i}", "--to", str(d / "got-s3"), "-q"]}
                for k, cmd in steps.items():
                    sec, r = run(cmd)
                    t[k].append(sec)
                    rss[k] = max(rss[k], r)
                    if k == "fetch_dir":  # keep the disk to one store and one fetched copy at a time
                        shutil.rmtree(d / "store")
                        shutil.rmtree(d / "got")
                shutil.rmtree(d / "got-s3")
                if i == 0:
                    again, _ = run(steps["pub_s3"])
                s3fs.S3FileSystem().rm(f"gkbench/r{i}", recursive=True)  # the server spills objects to /tmp
        m = {k: median(v) for k, v in t.items()}
        print(f"build: {a.layers} layers, {gib(size)}; {a.repeat} rounds, medians\n")
        print("| step | folder store | S3 (moto, 127.0.0.1) | S3 / folder | peak RSS folder | peak RSS S3 |")
        print("|---|---|---|---|---|---|")
        for name, kd, ks in (("publish", "pub_dir", "pub_s3"), ("fetch", "fetch_dir", "fetch_s3")):
            print(f"| {name} | {m[kd]:.2f} s ({size / m[kd] / 1e9:.2f} GB/s) | {m[ks]:.2f} s ({size / m[ks] / 1e9:.2f} GB/s)"
                  f" | {m[ks] / m[kd]:.2f}x | {gib(rss[kd])} | {gib(rss[ks])} |")
        print(f"| publish again to S3 (no-op) | | {again:.2f} s | | | |")


if __name__ == "__main__":
    main()
