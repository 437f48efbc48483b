"""gkbuild compile benchmarks (issue 4), each ratio measured in one run against its baseline.

(a) the 120b trn3 recipe (num_blocks given) on synth://gpt-oss-120b?layers=N, N = 2 and 4,
    against `cp -r` of the same source folder to the same disk (+ sync: compile syncs its
    outputs); builds and copies alternate --repeat times, medians reported. "cold" builds start
    with no remembered source fingerprints (the source is hashed), "warm" ones remember them.
(b) a no-op rebuild of the 120b-shaped build.
(c) the tiny-topology (TP8 x DP16 x EP128) build end to end.

    .venv/bin/python bench/bench_compile.py [--layers 2 4] [--repeat 3] [--dir /tmp/gkbench]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import cp_then_sync, dir_arg, gib, median, run, run_tree, scratch  # noqa: E402

from gkbuild.checkpoint.source import parse, synth_cache_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = str(Path(sys.executable).with_name("gkbuild"))


def compile_cmd(recipe: str, out: Path, *sets: str) -> list[str]:
    cmd = [GK, "compile", str(ROOT / "recipes" / recipe), "--out", str(out), "-q"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=3)
    dir_arg(ap, "/tmp/gkbench")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        print("| layers | source | cp -r + sync | compile cold | ratio | compile warm | ratio | peak RSS (largest process) "
              "| peak RSS (tree) | output |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for layers in a.layers:
            src = f"synth://gpt-oss-120b?layers={layers}"
            # synthesize the source once (outside the clock), like a downloaded checkpoint
            ck = synth_cache_dir(parse(src))
            run([GK, "synth", "gpt-oss-120b", "--layers", str(layers), "-q", "--out", str(ck)])
            size = sum(p.stat().st_size for p in ck.iterdir())
            cps, cold, warm, rss, tree = [], [], [], 0, 0
            for _ in range(a.repeat):
                for kind in ("cold", "warm"):
                    out = d / "build"
                    shutil.rmtree(out, ignore_errors=True)
                    if kind == "cold":
                        (d / "cache" / "fingerprints.json").unlink(missing_ok=True)
                    w, r, t = run_tree(compile_cmd("gpt-oss-120b-trn3.yaml", out, f"source={src}"))
                    (cold if kind == "cold" else warm).append(w)
                    rss, tree = max(rss, r), max(tree, t)
                shutil.rmtree(d / "copy", ignore_errors=True)
                cps.append(cp_then_sync(str(ck), str(d / "copy"))[0])
                shutil.rmtree(d / "copy", ignore_errors=True)
            outsize = sum(p.stat().st_size for p in (d / "build").rglob("*") if p.is_file())
            c, wc, ww = median(cps), median(cold), median(warm)
            print(f"| {layers} | {gib(size)} | {c:.2f} s | {wc:.2f} s | {wc / c:.2f}x | {ww:.2f} s | {ww / c:.2f}x "
                  f"| {gib(rss)} | {gib(tree)} | {gib(outsize)} |", flush=True)
        noop = [run(compile_cmd("gpt-oss-120b-trn3.yaml", d / "build", f"source=synth://gpt-oss-120b?layers={a.layers[-1]}"))[0]
                for _ in range(a.repeat)]
        print(f"\nno-op rebuild of the 120b-shaped build: {median(noop):.2f} s (median of {a.repeat})")
        topo = d / "topo"
        run([GK, "synth", "tiny-topology", "--layers", "2", "-q", "--out",
             str(synth_cache_dir(parse("synth://tiny-topology?layers=2&seed=0")))])
        walls = []
        for _ in range(a.repeat):
            shutil.rmtree(topo, ignore_errors=True)
            walls.append(run(compile_cmd("tiny-topology-trn3.yaml", topo))[0])
        m = json.loads((topo / "manifest.json").read_text())
        print(f"tiny-topology TP8 x DP16 x EP128 build end to end: {median(walls):.2f} s "
              f"({len(m['files'])} files, {m['topology']['world_size']} ranks)")


if __name__ == "__main__":
    main()
