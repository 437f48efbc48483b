"""``gkbuild compile --to s3://`` (the streamed build, issue 26) against ``compile`` + ``publish`` of
the same recipe, from the same S3 source into the same S3 server (moto on 127.0.0.1), in one run.

The gpt-oss-120b trn3 recipe on a synthesized N-layer 120b-shaped checkpoint, uploaded to
s3://src/ckpt (outside the clock). The server is moto's with ranged GETs that read only the bytes
asked for (``tests/moto_ranged.py``: moto 5.2.5 reads a whole object for each ranged GET); the
checkpoint's files are ``--file-size`` (1 GB; the hub's are ~4 GB, but moto's
CompleteMultipartUpload holds a whole object twice in memory: moto/s3/models.py:479-510). Each
round, alternating, each step with a fresh $GKBUILD_CACHE (so the baseline downloads its S3
mirror, as a fresh CI runner would) and a fresh store prefix:
- baseline: compile --out (the S3 source mirrored whole into the cache) + publish to S3 (the mirror
  is removed between the two, to spare the shared host's disk: its peak is at the end of compile);
- stream: compile --to s3://... --scratch-limit (local worker processes);
- ray: the same with --executor ray on a local 2-node cluster (one CPU a node; its nodes' gkbuild
  cache, where a task stages its shard, is ``ray-cache`` in the scratch folder).
Measured: wall time, peak local disk (the bytes under the cache, build and Ray nodes' cache
folders, sampled every 20 ms; the streamed build's own report beside it), peak RSS of the largest
process (of the command's tree, and of the Ray workers), the bytes read from the source against
its size (of them, the hash pass's), the load average around each step, and that every variant
produced the same build id.

    .venv/bin/python bench/bench_stream.py [--layers 2] [--repeat 1] [--dir /tmp/gkbench-stream]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from _measure import dir_arg, gib, run_tree, scratch  # noqa: E402
from gkbuild.pipeline.stream import DiskWatch  # noqa: E402
from tests.raycluster import members, ray_cluster  # noqa: E402
from tests.s3server import moto_server  # noqa: E402

GK = str(Path(sys.executable).with_name("gkbuild"))
RECIPE = str(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml")
SOURCE = "source=s3://src/ckpt"


class RayRss:
    """The peak RSS of the largest Ray worker process of a cluster (where ``--executor ray`` runs
    its shard jobs), sampled every 50 ms in a thread."""

    def __init__(self, cluster: dict | None):
        self.cluster, self.peak, self._stop = cluster, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.cluster and not self._stop.wait(0.05):
            for q in members(self.cluster["procs"]):
                with contextlib.suppress(psutil.Error):
                    if " ".join(q.cmdline()).startswith("ray::"):
                        self.peak = max(self.peak, q.memory_info().rss)

    def __enter__(self) -> "RayRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def step(name: str, cmd: list[str], d: Path, env: dict, cluster: dict | None = None) -> dict:
    """One timed command with a fresh cache (and build folder, and Ray nodes' cache), its local
    disk sampled."""
    cache = d / "cache"
    for p in (cache, d / "build", d / "ray-cache"):
        shutil.rmtree(p, ignore_errors=True)
    cache.mkdir()
    (d / "ray-cache").mkdir()
    load = os.getloadavg()
    with DiskWatch(cache, d / "build", d / "ray-cache") as disk, RayRss(cluster) as ray_rss:
        out = d / "out.json"
        with open(out, "w") as f:
            wall, rss, _ = run_tree(cmd, env=dict(env, GKBUILD_CACHE=str(cache)), stdout=f)
    rep = {"step": name, "wall": wall, "disk": disk.peak, "rss": rss, "ray_rss": ray_rss.peak,
           "load": [load, os.getloadavg()], "free": shutil.disk_usage(d).free}
    text = out.read_text()
    if text.strip().startswith("{"):
        rep["report"] = json.loads(text)
    return rep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--scratch-limit", default="2GiB")
    ap.add_argument("--file-size", default="1GB", help="the synthesized checkpoint's files (synth --max-shard-size)")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--only", choices=("baseline", "stream", "ray"), nargs="+",
                    help="run only these variants (e.g. to re-measure one after a change)")
    dir_arg(ap, "/tmp/gkbench-stream")
    ap.add_argument("--local", action="store_true",
                    help="a folder source (memory-mapped) and folder stores: no S3 server (no ranged reads)")
    a = ap.parse_args()
    with scratch(a.dir, cache=None, remove=False) as d:
        print(f"load before: {os.getloadavg()}; free disk {gib(shutil.disk_usage(d).free)}", flush=True)
        ck = d / "ckpt"
        t0 = time.perf_counter()
        subprocess.run([GK, "synth", "gpt-oss-120b", "--layers", str(a.layers), "-q", "--out", str(ck), "--max-shard-size",
                        a.file_size], check=True)
        files = ["config.json", "model.safetensors.index.json", *sorted(p.name for p in ck.glob("*.safetensors"))]
        source_bytes = sum((ck / n).stat().st_size for n in files)
        global SOURCE
        with (contextlib.nullcontext() if a.local else moto_server(log=str(d / "moto.log"))) as url:
            import boto3

            if a.local:
                SOURCE, s3 = f"source={ck}", None
            else:
                s3 = boto3.client("s3", endpoint_url=url)
                for b in ("src", "dst"):
                    s3.create_bucket(Bucket=b)
                for n in files:
                    s3.upload_file(str(ck / n), "src", f"ckpt/{n}")
                shutil.rmtree(ck)
            print(f"source: {a.layers} layers, {gib(source_bytes)} in {len(files)} files, {SOURCE} "
                  f"(synthesized and uploaded in {time.perf_counter() - t0:.0f} s)", flush=True)
            env = dict(os.environ)
            (d / "ray-cache").mkdir(exist_ok=True)
            os.environ["GKBUILD_CACHE"] = str(d / "ray-cache")  # the Ray nodes' (the cluster takes our environment)
            ray = not a.no_ray and (a.only is None or "ray" in a.only)
            with (ray_cluster(nodes=2, cpus=1, memory_gib=6) if ray else contextlib.nullcontext()) as cluster:
                os.environ.pop("GKBUILD_CACHE")
                rows = []
                for i in range(a.repeat):
                    plans = [("baseline", None), ("stream", "local"), ("ray", "ray")]
                    for name, executor in plans[i % 3:] + plans[:i % 3]:  # rotate: no variant always first
                        if name == "ray" and cluster is None or a.only and name not in a.only:
                            continue
                        to = str(d / f"store-{name}") if a.local else f"s3://dst/{name}-{i}"
                        if name == "baseline":
                            t0 = time.perf_counter()
                            r = step(name, ["sh", "-c", f'"{GK}" compile "{RECIPE}" --set {SOURCE} --out "{d}/build" '
                                                        f'--no-compile -q && rm -rf "{d}/cache/s3" && "{GK}" publish "{d}/build" --to {to} --json'],
                                     d, env)
                            r["wall"] = time.perf_counter() - t0
                            r["build_id"] = r["report"]["build_id"]
                            r["source_read"] = 0 if a.local else source_bytes  # the mirror downloads every file once
                        else:
                            e = dict(env, RAY_ADDRESS=cluster["gcs"]) if executor == "ray" else env
                            r = step(name, [GK, "compile", RECIPE, "--set", SOURCE, "--to", to, "--no-compile", "--json",
                                            "--scratch-limit", a.scratch_limit, "--executor", executor], d, e,
                                     cluster if executor == "ray" else None)
                            r["build_id"] = r["report"]["build_id"]
                            r["source_read"] = r["report"]["stream"]["source_read"]
                            r["source_hashed"] = r["report"]["stream"]["source_hashed"]
                            r["reported_disk"] = r["report"]["stream"]["peak_disk"]
                        r.pop("report", None)
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                        if a.local:
                            shutil.rmtree(to)
                        else:
                            s3fs_rm(s3, "dst", f"{name}-{i}/")
                shutil.rmtree(d / "build", ignore_errors=True)
        print(f"load after: {os.getloadavg()}")
        ids = {r["build_id"] for r in rows}
        print(f"build ids: {'all equal' if len(ids) == 1 else ids}")
        base = [r["wall"] for r in rows if r["step"] == "baseline"]
        print(f"{'step':9} {'wall s':>8} {'x base':>7} {'disk':>10} {'reported':>10} {'rss':>10} {'ray rss':>10} "
              f"{'read/size':>9} {'hashed':>7}")
        for r in rows:
            print(f"{r['step']:9} {r['wall']:8.1f} {r['wall'] / min(base) if base else float('nan'):7.2f} {gib(r['disk']):>10} "
                  f"{gib(r.get('reported_disk', 0)):>10} {gib(r['rss']):>10} {gib(r['ray_rss']):>10} "
                  f"{r['source_read'] / source_bytes:9.2f} {r.get('source_hashed', 0) / source_bytes:7.2f}")


def s3fs_rm(s3, bucket: str, prefix: str) -> None:
    """Free the server's disk between rounds."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})


if __name__ == "__main__":
    main()
