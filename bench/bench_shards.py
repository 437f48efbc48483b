"""Build speed (issue 21): the 2-layer 120b-shaped build (the shards are nearly all of it) against
`cp -r` + `sync` of the same source, alternating, in one run; wall and CPU seconds.

Each round, in an order that starts one run later every round (so no run always follows cp): `cp
-r SRC COPY && sync`; a build with this tree into a fresh folder (warm: the
source's fingerprints remembered, as for any hub source or a second recipe on the checkpoint;
cold: forgotten, so the build also hashes the 5.4 GiB source); with `--baseline DIR`, the same
builds with the gkbuild of another checkout (e.g. /work/main), for a before/after in the same run,
and every shard's sha256 compared between the two trees' builds (the bytes must not change).
CPU seconds are the build's whole process tree (wait4: the parent and its reaped workers). On a
shared machine wall times follow the load (a CPU-bound build is slowed by other processes far
more than a disk-bound cp); the CPU seconds do not, and the run reports the load.

    .venv/bin/python bench/bench_shards.py [--repeat 3] [--baseline /work/main] [--dir /tmp/gkbench-shards]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, gib, median, scratch, timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="another gkbuild checkout to compare with")
    dir_arg(ap, "/tmp/gkbench-shards")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        env = dict(os.environ)
        trees = {"this tree": ROOT} | ({"baseline": Path(a.baseline)} if a.baseline else {})
        res: dict[str, list] = {}
        loads = []
        shas: dict[str, dict] = {}  # tree -> {path: sha256} of its last build

        def build(tree: Path, kind: str, out: Path):
            if kind == "cold":
                (d / "cache" / "fingerprints.json").unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "gkbuild", "compile", str(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml"),
                   "--out", str(out), "--no-compile", "--json", "--set", f"source=synth://gpt-oss-120b?layers={a.layers}"]
            return timed(cmd, cwd=tree, env=dict(env, PYTHONPATH=str(tree)))

        build(ROOT, "cold", d / "build")  # untimed: synthesizes the source; its fingerprints, the page cache
        ck = next(p for p in (d / "cache" / "synth").iterdir() if p.is_dir())  # the source the builds read: cp copies it
        size = sum(p.stat().st_size for p in ck.iterdir())
        outsize = sum(p.stat().st_size for p in (d / "build").rglob("*") if p.is_file() and ".gkbuild" not in p.parts)
        runs = ["cp"] + [(name, kind) for name in trees for kind in ("warm", "cold")]
        for r in range(a.repeat):
            # Each round starts one run later: no run always comes right after cp (whose writes the
            # host may still be flushing), and the first warm build has its fingerprints.
            for run in runs[r % len(runs):] + runs[:r % len(runs)]:
                shutil.rmtree(d / "copy", ignore_errors=True)
                shutil.rmtree(d / "build", ignore_errors=True)
                if run == "cp":
                    wall, cpu, _, _ = timed(["sh", "-c", f'cp -r "{ck}" "{d / "copy"}" && sync'])
                    res.setdefault("cp", []).append((wall, cpu))
                    continue
                wall, cpu, js, rss = build(trees[run[0]], run[1], d / "build")
                shards = next(s["seconds"] for s in json.loads(js)["stages"] if s["name"] == "shards")
                files = json.loads((d / "build" / "manifest.json").read_text())["files"]
                shas[run[0]] = {f["path"]: f["sha256"] for f in files}
                res.setdefault(f"{run[0]} {run[1]}", []).append([wall, cpu, shards, r, rss])
            loads.append(os.getloadavg()[0])
        for name, rows in res.items():
            for row in rows if name != "cp" else []:  # each build's ratio to the cp of its own round
                row[3] = row[0] / res["cp"][row[3]][0]
        cp_wall, cp_cpu = median([w for w, _ in res["cp"]]), median([c for _, c in res["cp"]])
        print(f"source {gib(size)}, output {gib(outsize)}; medians of {a.repeat} alternating rounds; load average "
              f"(1 min) after each round: {', '.join(f'{x:.1f}' for x in loads)}\n")
        cp_walls = sorted(w for w, _ in res["cp"])
        print("wall by round (a slow round shows as itself, not only in a median):")
        for name, rows in res.items():
            print(f"  {name}: {', '.join(f'{r[0]:.2f} s' for r in rows)}")
        print()
        print("| run | wall | ratio to cp | ratio in each round (min-max) | shards stage | CPU s | CPU s / GiB out "
              "| CPU s / 2 cores vs cp | peak RSS, largest process |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| cp -r + sync | {cp_wall:.2f} s | 1.00x | {cp_walls[0]:.2f}-{cp_walls[-1]:.2f} s | | {cp_cpu:.1f} "
              f"| | | |")
        for name, rows in res.items():
            if name == "cp":
                continue
            w, c, s = (median([r[i] for r in rows]) for i in range(3))
            ratios = sorted(r[3] for r in rows)
            print(f"| build, {name} | {w:.2f} s | {w / cp_wall:.2f}x | {ratios[0]:.2f}-{ratios[-1]:.2f}x | {s:.2f} s "
                  f"| {c:.1f} | {c / (outsize / 2**30):.2f} | {c / 2 / cp_wall:.2f}x | {gib(max(r[4] for r in rows))} |")
        if len(shas) == 2:
            a, b = shas.values()
            differ = sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))
            print(f"\nfiles of the two trees' builds: {len(a)} and {len(b)}; sha256 identical: "
                  f"{'all' if not differ else f'NO, {len(differ)} differ: {differ[:5]}'}")


if __name__ == "__main__":
    main()
