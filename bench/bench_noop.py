"""Planning is cheap (issues 21, 28): a no-op `gkbuild compile` (every stage cached) of the
120b-shaped build as a whole process, against the bare interpreter and (``--baseline DIR``) the
gkbuild of another checkout, alternating in the same run; wall and CPU seconds, and what it imports.

The 120b trn3 recipe on synth://gpt-oss-120b?layers=2 is built once (its NEFF stage is skipped
without the Neuron SDK, as on any host without it); then `--repeat` rounds each time a no-op
compile with every tree (checked: did_work false) and `python -c pass`, in an order that starts
one later every round; medians. The trees share the build folder (their state files agree; each
run is checked to be a no-op). CPU seconds (user + system, wait4) do not move with the host's
load as the wall does. `python -X importtime` of one no-op names the slowest imports, and the
heavy libraries (torch, transformers, s3fs, ml_dtypes, jsonschema, numpy) must be absent.

    .venv/bin/python bench/bench_noop.py [--layers 2] [--repeat 9] [--baseline DIR] [--dir /tmp/gkbench-noop]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, median, run, scratch, timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "s3fs", "ml_dtypes", "jsonschema", "numpy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--baseline", default=None, help="another gkbuild checkout to compare with")
    dir_arg(ap, "/tmp/gkbench-noop")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        trees = {"this tree": ROOT} | ({"baseline": Path(a.baseline)} if a.baseline else {})
        args = ["compile", str(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml"), "--json",
                "--set", f"source=synth://gpt-oss-120b?layers={a.layers}"]

        def gk(tree: Path, *extra: str) -> tuple[list[str], dict]:
            """A tree's no-op into a build folder of its own (two trees' stage keys may differ: one
            folder between them would make each run redo what the other's run keyed otherwise)."""
            out = d / f"build-{list(trees.values()).index(tree)}"
            return ([sys.executable, *extra, "-m", "gkbuild", *args, "--out", str(out)],
                    {"cwd": tree, "env": dict(os.environ, PYTHONPATH=str(tree))})

        for tree in trees.values():  # the build (synthesizing the source), then each tree's first no-op
            for _ in range(2):
                cmd, kw = gk(tree)
                run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        runs = list(trees) + ["bare interpreter"]
        res: dict[str, list[tuple[float, float]]] = {r: [] for r in runs}
        loads = []
        for r in range(a.repeat):
            for name in runs[r % len(runs):] + runs[:r % len(runs)]:
                if name == "bare interpreter":
                    wall, cpu, _, _ = timed([sys.executable, "-c", "pass"])
                else:
                    cmd, kw = gk(trees[name])
                    wall, cpu, out, _ = timed(cmd, **kw)
                    if json.loads(out)["did_work"]:
                        raise SystemExit(f"{name}: the no-op did work: {out}")
                res[name].append((wall, cpu))
            loads.append(os.getloadavg()[0])
        cmd, kw = gk(ROOT, "-X", "importtime")
        imp = subprocess.run(cmd, capture_output=True, text=True, **kw).stderr
        rows = [(int(m.group(2)), m.group(3).strip()) for m in re.finditer(r"import time:\s+(\d+) \|\s+(\d+) \|(.*)", imp)]
        top = sorted((r for r in rows if not r[1].startswith(" ")), reverse=True)[:6]
        heavy = sorted({name.strip().split(".")[0] for _, name in rows} & set(HEAVY))
        print(f"{a.repeat} alternating rounds, medians; load average (1 min) after each round: "
              f"{', '.join(f'{x:.1f}' for x in loads)}\n")
        print("| run | wall | CPU s | wall by round |")
        print("|---|---|---|---|")
        for name in runs:
            what = f"no-op compile, {name}" if name in trees else "bare interpreter (`python -c pass`)"
            walls = [w for w, _ in res[name]]
            print(f"| {what} | {median(walls):.3f} s | {median([c for _, c in res[name]]):.3f} | "
                  f"{', '.join(f'{w:.2f}' for w in walls)} |")
        if a.baseline:
            ratio = median([w for w, _ in res["this tree"]]) / median([w for w, _ in res["baseline"]])
            cpu = median([c for _, c in res["this tree"]]) / median([c for _, c in res["baseline"]])
            print(f"\nthis tree / baseline: wall {ratio:.2f}x, CPU {cpu:.2f}x")
        print("slowest top-level imports (cumulative):", ", ".join(f"{n} {us / 1e3:.0f} ms" for us, n in top))
        print(f"heavy libraries imported: {heavy or 'none'}")


if __name__ == "__main__":
    main()
