"""Quantizing a bf16 fine-tune (issue 35): the 2-layer 120b-shaped model synthesized in both layouts
(``gkbuild synth gpt-oss-120b --layers 2`` and the same with ``--dtype bf16``: the same tensors but
the experts, dense and off the MXFP4 grid), then, in one run:

- ``cp``: ``cp -r`` of the bf16 checkpoint + ``sync`` (the baseline: reading and writing its bytes);
- ``quantize``: ``gkbuild quantize BF16 --out MX`` (the command);
- ``build mxfp4``: ``compile gpt-oss-120b-trn3 --no-compile`` from the MXFP4 synth;
- ``build bf16``: the same recipe from the bf16 synth (its experts quantized as the expert shards are
  written, the build's quantize stage).

Both builds run warm (the sources' fingerprints remembered by a first build, so neither hashes its
source on the clock) into fresh folders. Reported: wall, CPU (the tree's user + system), peak RSS
(largest process), MB/s of the bf16 source's bytes, and each against ``cp`` and against the MXFP4
build; the expert shards of the two builds compared (equal only where the bf16 experts are on the
grid, which synth's are not: the count of equal shards is printed, not asserted).

    .venv/bin/python bench/bench_quantize.py [--layers 2] [--dir /tmp/gkbench-quantize]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, gib, measure, scratch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = [sys.executable, "-m", "gkbuild"]
RECIPE = str(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml")


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(src: Path, out: Path) -> dict:
    return measure([*GK, "compile", RECIPE, "--out", str(out), "--no-compile", "-q", "--set", f"source={src}"],
                   stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    dir_arg(ap, "/tmp/gkbench-quantize")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        mx, bf = d / "mx", d / "bf16"
        subprocess.run([*GK, "synth", "gpt-oss-120b", "--layers", str(a.layers), "--out", str(mx), "-q"], check=True)
        subprocess.run([*GK, "synth", "gpt-oss-120b", "--layers", str(a.layers), "--dtype", "bf16", "--out", str(bf),
                        "-q"], check=True)
        for src in (mx, bf):  # warm: each source hashed once, off the clock
            build(src, d / "warmup")
            shutil.rmtree(d / "warmup")
        n = size(bf)
        rows = {"cp": measure(["sh", "-c", f"cp -r {bf} {d / 'copy'} && sync"])}
        shutil.rmtree(d / "copy")
        rows["quantize"] = measure([*GK, "quantize", str(bf), "--out", str(d / "quantized"), "-q"])
        shutil.rmtree(d / "quantized")
        rows["build mxfp4"] = build(mx, d / "b-mx")
        rows["build bf16"] = build(bf, d / "b-bf16")
        man = {k: json.loads((d / k / "manifest.json").read_text()) for k in ("b-mx", "b-bf16")}
        experts = [{f["path"]: f["sha256"] for f in man[k]["files"] if f.get("role") == "expert"} for k in man]
        same = sum(experts[0][p] == experts[1].get(p) for p in experts[0])
        print(f"source: {a.layers}-layer 120b, bf16 {n / 1e9:.2f} GB, mxfp4 {size(mx) / 1e9:.2f} GB; "
              f"expert shards equal between the builds: {same} of {len(experts[0])}")
        print("| step | wall | CPU | peak RSS | MB/s of the bf16 source | vs cp | vs build mxfp4 | load |")
        print("|---|---|---|---|---|---|---|---|")
        for name, m in rows.items():
            vs_build = f"{m['wall'] / rows['build mxfp4']['wall']:.2f}x" if name.startswith("build") else ""
            print(f"| {name} | {m['wall']:.1f} s | {m['cpu']:.1f} s | {gib(m['rss'])} | "
                  f"{n / m['wall'] / 1e6:.0f} | {m['wall'] / rows['cp']['wall']:.2f}x | {vs_build} | "
                  f"{m['load'][0]:.1f} -> {m['load'][1]:.1f} |")


if __name__ == "__main__":
    main()
