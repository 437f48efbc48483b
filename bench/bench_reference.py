"""Golden and verify at the real model's widths (issue 12): `gkbuild golden` of 120b-shaped
checkpoints of 2 and 4 layers (1 prompt x 8 positions: 4 prompt tokens + 4 greedy steps, FP8
e4m3 KV as trn2 stores it), `gkbuild verify` of the 2-layer checkpoint's 128-rank trn2 build
(TP8 x DP16 x EP128, --no-compile) against that golden, and the extrapolation to the 36-layer
model. Run alone: it holds one 120b-width process at a time.

    .venv/bin/python bench/bench_reference.py [--layers 2 4] [--dir /tmp/gkbench-ref]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import gib, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = str(Path(sys.executable).with_name("gkbuild"))
PROMPT, STEPS = 4, 4


def per_unit_costs(ckpt: Path) -> dict:
    """In a child process: seconds to load one decoder layer's modules and to dequantize one
    expert at 120b widths (medians of 5), on one thread."""
    code = f"""
import json, statistics, time, torch
torch.set_num_threads(1)
from gkbuild import reference
from gkbuild.checkpoint.reader import Checkpoint
ck = Checkpoint.open({str(ckpt)!r}); cfg = reference.hf_config(ck.root, reference.KvFormat("fp8_e4m3"))
def t(f):
    out = []
    for _ in range(5):
        s = time.perf_counter(); f(); out.append(time.perf_counter() - s)
    return statistics.median(out)
layer = reference.Layer(ck, cfg, 0, "cpu")
burst = lambda w: t(lambda: [None for _ in reference._ahead(layer.expert, list(range(8)), w)])
print(json.dumps({{"layer_load": t(lambda: reference.Layer(ck, cfg, 0, "cpu")),
                  "expert_dequant": t(lambda: layer.expert(3)), "eight_w1": burst(1), "eight_w2": burst(2)}}))
"""
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dir", default="/tmp/gkbench-ref")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints for another run")
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    os.environ["GKBUILD_CACHE"] = str(d / "cache")
    T = PROMPT + STEPS
    print(f"| run | layers | wall | per position | peak RSS |")
    print("|---|---|---|---|---|")
    golden_wall = {}
    for L in a.layers:
        ck = d / f"ck{L}"
        if not (ck / "config.json").exists():
            run([GK, "synth", "gpt-oss-120b", "--layers", str(L), "--out", str(ck)], stdout=subprocess.DEVNULL)
        g = d / f"golden{L}.safetensors"
        wall, rss = run([GK, "golden", str(ck), "--out", str(g), "--prompts", "1", "--prompt-len", str(PROMPT),
                         "--steps", str(STEPS), "--kv", "fp8_e4m3", "-q"], stderr=subprocess.DEVNULL)
        golden_wall[L] = wall
        print(f"| golden, 1 x {T} positions | {L} | {wall:.1f} s | {wall / T:.2f} s | {gib(rss)} |", flush=True)
    L0 = min(a.layers)
    ck, out = d / f"ck{L0}", d / "build"
    shutil.rmtree(out, ignore_errors=True)
    run([GK, "compile", str(ROOT / "recipes" / "gpt-oss-120b-trn2.yaml"), "--set", f"source={ck}", "--out", str(out),
         "--no-compile", "-q"], stdout=subprocess.DEVNULL)
    wall, rss = run([GK, "verify", str(out), "--golden", str(d / f"golden{L0}.safetensors"), "--json", "-q"],
                    stdout=open(d / "verify.json", "w"))
    rep = json.loads((d / "verify.json").read_text())
    print(f"| verify, 128-rank trn2 build, {T} decode steps | {L0} | {wall:.1f} s | {wall / T:.2f} s | {gib(rss)} |")
    print(f"\nverify: ok={rep['ok']}, max |err| {rep['max_abs_err']:.4f}, forced {rep['routing_forced']} of "
          f"{rep['routing_total']}, layer errors {[f'{e:.2g}' for e in rep['layer_errors']]}")
    shutil.rmtree(out, ignore_errors=True)

    # extrapolation: the golden's time is linear in layers (one pass per position chunk, each
    # layer loaded once a pass), its memory flat
    unit = per_unit_costs(d / f"ck{L0}")
    if len(a.layers) > 1:
        L1 = max(a.layers)
        per_layer = (golden_wall[L1] - golden_wall[L0]) / (L1 - L0)
        fixed = golden_wall[L0] - per_layer * L0
        print(f"\ngolden: {fixed:.1f} s fixed + {per_layer:.1f} s per layer for 1 x {T} positions "
              f"({per_layer / (STEPS + 1):.2f} s per layer per pass); 36 layers: {fixed + 36 * per_layer:.0f} s, "
              f"{(fixed + 36 * per_layer) / T:.1f} s per position")
    speedup = unit["eight_w1"] / unit["eight_w2"]
    print(f"per unit: layer load {unit['layer_load']:.3f} s, one expert dequantized {unit['expert_dequant']:.3f} s; "
          f"8 experts on 1 / 2 dequant threads: {unit['eight_w1']:.2f} / {unit['eight_w2']:.2f} s ({speedup:.2f}x)")
    # 4 prompts x 32 positions (4 prompt + 28 greedy): one prefill pass of 16 tokens x top-4 over
    # 128 experts, then 28 passes of 4 tokens x top-4; experts hit per layer pass: expected distinct
    P, E, k, passes = 4, 128, 4, 28
    hit = lambda picks: E * (1 - (1 - 1 / E) ** picks)  # noqa: E731
    experts = 36 * (hit(P * PROMPT * k) + passes * hit(P * k))
    layers = 36 * (1 + passes)
    serial = experts * unit["expert_dequant"] + layers * unit["layer_load"]
    two = experts * unit["expert_dequant"] / speedup + layers * unit["layer_load"]
    wide = experts * unit["expert_dequant"] / 8 + layers * unit["layer_load"]  # 8 dequant threads, ideal
    print(f"gpt-oss-120b, 4 prompts x 32 positions: {experts:.0f} expert dequantizations, {layers} layer loads: "
          f"~{serial / 3600:.1f} h serial, ~{two / 3600:.1f} h on a 2-core host (2 dequant threads as measured), "
          f"~{wide / 60:.0f} min on a 64-core host (8 dequant threads, if they scale)")
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
