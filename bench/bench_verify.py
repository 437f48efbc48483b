"""How long `gkbuild verify` takes on the two tiny builds (issue 5), the reference computed on the
fly (transformers) and from a stored golden file; and (issue 18) the faithful noise floor each
build shows: its layers' worst and median hidden-state error on the reference's input.

    .venv/bin/python bench/bench_verify.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, gib, median, run, scratch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = str(Path(sys.executable).with_name("gkbuild"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    dir_arg(ap, "/tmp/gkbench-verify")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        print("| build | ranks emulated | KV | verify, golden computed | verify, golden file | peak RSS | "
              "local error by layer: worst / median |")
        print("|---|---|---|---|---|---|---|")
        # (recipe, overrides, source, the KV format the build stores: the golden emulates it)
        cases = [("tiny-cpu.yaml", [], "synth://tiny?layers=2&seed=0", "bf16"),
                 ("tiny-cpu.yaml", ["kv_cache.dtype=fp8", "kv_cache.packed=true"], "synth://tiny?layers=2&seed=0",
                  "fp8_e4m3fn"),
                 ("tiny-topology-trn3.yaml", ["kv_cache.dtype=bf16", "kv_cache.packed=false"],
                  "synth://tiny-topology?layers=2&seed=0", "bf16"),
                 ("tiny-topology-trn3.yaml", [], "synth://tiny-topology?layers=2&seed=0", "fp8_e4m3fn")]
        for recipe, sets, src, kv_format in cases:
            out = d / "build"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [GK, "compile", str(ROOT / "recipes" / recipe), "--out", str(out), "-q"]
            for s in sets:
                cmd += ["--set", s]
            run(cmd)
            golden = d / "golden.safetensors"
            run([GK, "golden", src, "--out", str(golden), "--steps", "16", "--kv", kv_format],
                stderr=open(os.devnull, "w"))
            fly = [run([GK, "verify", str(out), "--json"], stdout=open(os.devnull, "w")) for _ in range(a.repeat)]
            stored = [run([GK, "verify", str(out), "--golden", str(golden), "--json"], stdout=open(d / "rep.json", "w"))
                      for _ in range(a.repeat)]
            rep = json.loads((d / "rep.json").read_text())
            floor = ", ".join(f"{w:.1e} / {m:.1e}" for w, m in zip(rep["layer_local_errors"], rep["layer_local_median"]))
            m = json.loads((out / "manifest.json").read_text())
            ranks, lay = m["topology"]["world_size"], m["layout"]["kv"]
            kv = ("packed " if lay["packed"] else "") + lay["dtype"]
            print(f"| {recipe} | {ranks} | {kv} | {median([w for w, _ in fly]):.2f} s | "
                  f"{median([w for w, _ in stored]):.2f} s | {gib(max(r for _, r in fly + stored))} | {floor} |", flush=True)


if __name__ == "__main__":
    main()
