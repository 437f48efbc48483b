"""The 120b end to end on one small machine (issue 34): the 36-layer gpt-oss-120b-shaped model
from the range-addressable source ``synth://gpt-oss-120b?layers=N&seed=0`` (generated as it is
read, never written), built, its golden computed, and verified where it is stored.

Steps (each a fresh ``$GKBUILD_CACHE`` and ``$TMPDIR`` under the scratch folder, both sampled):
- ``build-dir``: ``compile RECIPE --to DIR/store`` (the streamed build into a folder store);
- ``golden``: ``golden SRC --forced`` at 4 sequences x 32 positions (4 prompt + 28 given), so one
  layer-major pass reads every layer's weights once (its ``--json`` counts the bytes read);
- ``verify``: ``verify DIR/store --golden G`` in place (raw blobs hashed, then mapped where they lie);
- ``build-s3``: the streamed build into an S3 store on 127.0.0.1 (``tests/moto_ranged.py``, its objects
  spooled under the scratch folder), after the folder store is removed (both do not fit this disk
  at 36 layers); ``verify-s3``: verify of that store in place.
Measured for each: wall, CPU (user + system of the tree), peak RSS (largest process), peak local
disk (cache + TMPDIR, beyond the store), bytes read (the source's, as the command reports them,
against the source's size; for verify, what its processes read from storage against the build's
size), the load average around it. A step that fails ends the bench.

    .venv/bin/python bench/bench_e2e.py [--layers 36] [--only build-dir golden verify build-s3] [--dir /tmp/gkbench-e2e]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from _measure import dir_arg, gib, measure, scratch  # noqa: E402
from gkbuild.pipeline.stream import DiskWatch  # noqa: E402
from tests.s3server import moto_server  # noqa: E402

GK = str(Path(sys.executable).with_name("gkbuild"))
RECIPE = str(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml")
STEPS = ("build-dir", "golden", "verify", "build-s3", "verify-s3")


def step(name: str, cmd: list[str], d: Path) -> dict:
    """One command with a fresh cache and TMPDIR, its local disk sampled; its --json report kept."""
    local = [d / "cache", d / "tmp"]
    for p in local:
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir()
    env = dict(os.environ, GKBUILD_CACHE=str(local[0]), TMPDIR=str(local[1]), GKBUILD_SYNTH_READ="range")
    print(f"{name}: {' '.join(cmd)}", flush=True)
    with DiskWatch(*local) as disk, open(d / f"{name}.json", "w") as out:
        m = measure(cmd, env=env, stdout=out)
    text = (d / f"{name}.json").read_text()
    row = {"step": name, **m, "disk": disk.peak, "free": shutil.disk_usage(d).free,
           "report": json.loads(text) if text.strip().startswith("{") else None}
    print(json.dumps({k: v for k, v in row.items() if k != "report"}), flush=True)
    return row


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--scratch-limit", default="2GiB")
    dir_arg(ap, "/tmp/gkbench-e2e")
    a = ap.parse_args()
    src = f"synth://gpt-oss-120b?layers={a.layers}&seed=0"
    with scratch(a.dir, cache=None, resume=True, remove=False) as d:
        print(f"source {src}; load {os.getloadavg()}; free disk {gib(shutil.disk_usage(d).free)}", flush=True)
        rows, store, golden = [], d / "store", d / "golden.safetensors"
        if "build-dir" in a.only:
            shutil.rmtree(store, ignore_errors=True)
            r = step("build-dir", [GK, "compile", RECIPE, "--set", f"source={src}", "--to", str(store), "--no-compile",
                                   "--scratch-limit", a.scratch_limit, "--json", "-q"], d)
            r["store_bytes"] = store_bytes(store)
            rows.append(r)
        if "golden" in a.only:
            rows.append(step("golden", [GK, "golden", src, "--out", str(golden), "--forced", "--prompts", "4",
                                        "--prompt-len", "4", "--steps", "28", "--kv", "fp8_e4m3fn", "--json", "-q"], d))
        if "verify" in a.only:
            r = step("verify", [GK, "verify", str(store), "--golden", str(golden), "--scratch-limit", a.scratch_limit,
                                "--json", "-q"], d)
            r["store_bytes"] = store_bytes(store)
            rows.append(r)
        if {"build-s3", "verify-s3"} & set(a.only):
            shutil.rmtree(store, ignore_errors=True)  # both stores do not fit this disk at 36 layers
            (d / "moto-tmp").mkdir(exist_ok=True)
            tmp = os.environ.get("TMPDIR")
            os.environ["TMPDIR"] = str(d / "moto-tmp")  # the server's spooled objects: the store, not scratch
            with moto_server(log=str(d / "moto.log")):
                import boto3

                os.environ.pop("TMPDIR") if tmp is None else os.environ.update(TMPDIR=tmp)
                boto3.client("s3").create_bucket(Bucket="dst")
                r = step("build-s3", [GK, "compile", RECIPE, "--set", f"source={src}", "--to", "s3://dst/b",
                                      "--no-compile", "--scratch-limit", a.scratch_limit, "--json", "-q"], d)
                r["store_bytes"] = store_bytes(d / "moto-tmp")
                rows.append(r)
                if "verify-s3" in a.only:
                    r = step("verify-s3", [GK, "verify", "s3://dst/b", "--golden", str(golden), "--scratch-limit",
                                           a.scratch_limit, "--json", "-q"], d)
                    r["store_bytes"] = rows[-1]["store_bytes"]
                    rows.append(r)
            shutil.rmtree(d / "moto-tmp", ignore_errors=True)
        with open(d / "rows.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"load after: {os.getloadavg()}")
        table(rows)


def table(rows: list[dict]) -> None:
    print("| step | wall | CPU | peak RSS | peak local disk | bytes read / size | load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rep, read = r["report"] or {}, "?"
        with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
            if r["step"].startswith("build"):
                s = rep["stream"]
                read = (f"{s['source_read'] / s['source_bytes']:.2f}x source (of it the hash pass "
                        f"{s['source_hashed'] / s['source_bytes']:.2f}x)")
            elif r["step"] == "golden":
                read = f"{rep['bytes_read'] / rep['source_bytes']:.2f}x source"
            else:
                read = f"{rep['store_read']['read'] / rep['store_read']['stored']:.2f}x store"
        print(f"| {r['step']} | {r['wall']:.0f} s | {r['cpu']:.0f} s | {gib(r['rss'])} | {gib(r['disk'])} | "
              f"{read} | {r['load'][0]:.1f} -> {r['load'][1]:.1f} |")


if __name__ == "__main__":
    main()
