"""gkbuild publish + fetch (issue 7) of the 120b-shaped build, against `cp -r` of the same bytes.

The gpt-oss-120b trn2 recipe on synth://gpt-oss-120b?layers=N is built once (outside the clock);
then, --repeat times, alternating: `cp -r` of the build folder + sync (the baseline: same bytes,
same disk, flushed, since publish and fetch fsync), `gkbuild publish` into a fresh folder store,
`gkbuild fetch` of that store into a fresh folder. Medians; peak RSS of the largest process;
the stored/raw ratio per file kind from the publish report; a no-op republish.

    .venv/bin/python bench/bench_publish.py [--layers 2] [--repeat 3] [--dir /tmp/gkbench-pub]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import build_120b, cp_then_sync, dir_arg, gib, median, run, scratch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = str(Path(sys.executable).with_name("gkbuild"))
sys.path.insert(0, str(ROOT))
from gkbuild.publish.index import by_kind  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    dir_arg(ap, "/tmp/gkbench-pub")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        build, size = build_120b(d, a.layers, GK, ROOT)
        cps, pubs, fetches, rss_pub, rss_fetch = [], [], [], 0, 0
        for _ in range(a.repeat):
            for p in ("copy", "store", "got"):
                shutil.rmtree(d / p, ignore_errors=True)
            cps.append(cp_then_sync(str(build), str(d / "copy"))[0])
            shutil.rmtree(d / "copy")
            t, r = run([GK, "publish", str(build), "--to", str(d / "store"), "-q"])
            pubs.append(t)
            rss_pub = max(rss_pub, r)
            t, r = run([GK, "fetch", str(d / "store"), "--to", str(d / "got"), "-q"])
            fetches.append(t)
            rss_fetch = max(rss_fetch, r)
        again, _ = run([GK, "publish", str(build), "--to", str(d / "store"), "-q"])
        rep = json.loads(subprocess.run([GK, "publish", str(build), "--to", str(d / "store"), "--json"],
                                        capture_output=True, text=True, check=True).stdout)
        stored = sum(p.stat().st_size for p in (d / "store").rglob("*") if p.is_file())
        cp = median(cps)
        print(f"build: {a.layers} layers, {gib(size)} in {sum(1 for _ in build.rglob('*.safetensors'))} shards; "
              f"store {gib(stored)}\n")
        print("| step | seconds | GB/s | ratio to cp -r + sync | peak RSS |")
        print("|---|---|---|---|---|")
        print(f"| cp -r + sync | {cp:.2f} | {size / cp / 1e9:.2f} | 1.00x | |")
        print(f"| publish (folder store) | {median(pubs):.2f} | {size / median(pubs) / 1e9:.2f} | "
              f"{median(pubs) / cp:.2f}x | {gib(rss_pub)} |")
        print(f"| fetch (verify, decompress) | {median(fetches):.2f} | {size / median(fetches) / 1e9:.2f} | "
              f"{median(fetches) / cp:.2f}x | {gib(rss_fetch)} |")
        print(f"| publish again (no-op) | {again:.2f} | | {again / cp:.2f}x | |")
        print("\n| file kind | files | bytes | stored | stored/raw | zstd files |")
        print("|---|---|---|---|---|---|")
        for name, k in by_kind(rep["entries"]).items():
            print(f"| {name} | {k['files']} | {k['bytes'] / 2**20:.1f} MiB | {k['stored'] / 2**20:.1f} MiB | "
                  f"{k['stored'] / k['bytes']:.3f} | {k['zstd']} |")


if __name__ == "__main__":
    main()
