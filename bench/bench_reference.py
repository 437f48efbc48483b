"""Golden + verify of a gpt-oss-120b-shaped trn2 build at full width (issue 18): for each layer
count, `gkbuild synth gpt-oss-120b --layers N`, `gkbuild golden` of it (4 prompts x 32 positions:
4 prompt tokens + 28 greedy steps, FP8 e4m3 KV as trn2 stores it), the build from
`recipes/gpt-oss-120b-trn2.yaml` (TP8 x DP16 x EP128, `--no-compile`), and `gkbuild verify` of it
against that golden. Wall and CPU seconds (user + system) and peak RSS of each command, the load
average around it (the machine is shared), and a least-squares line through the layer counts
projected to the 36-layer model. Run alone: one 120b-width process at a time. Disk: a checkpoint
and its build of the largest N at once (~33 GB at 8 layers); each is removed when done.
`--resume` keeps what an interrupted run (e.g. a full disk) measured and made in ``--dir``.

    .venv/bin/python bench/bench_reference.py [--layers 2 4 8] [--dir /tmp/gkbench-ref] [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import gib, run, run_cpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = str(Path(sys.executable).with_name("gkbuild"))
MODEL_LAYERS = 36


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--dir", default="/tmp/gkbench-ref")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--resume", action="store_true", help="keep the measurements and files already in --dir")
    a = ap.parse_args()
    d = Path(a.dir)
    if not a.resume:
        shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True, exist_ok=True)
    os.environ["GKBUILD_CACHE"] = str(d / "cache")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    T = a.prompt_len + a.steps
    print(f"{a.prompts} prompts x {T} positions ({a.prompt_len} prompt tokens + {a.steps} greedy), FP8 e4m3 KV; "
          f"{os.cpu_count()} cores")
    print("| run | layers | wall | CPU | wall per layer-position | CPU per layer-position | peak RSS | load before/after |")
    print("|---|---|---|---|---|---|---|---|")
    rows = {"golden": {}, "verify": {}}
    for L in a.layers:
        ck, g, out = d / f"ck{L}", d / f"golden{L}.safetensors", d / f"build{L}"
        measured = {kind: d / f"measured-{kind}{L}.json" for kind in rows}
        if not measured["golden"].exists():
            if not (ck / "config.json").exists():
                shutil.rmtree(ck, ignore_errors=True)
                run([GK, "synth", "gpt-oss-120b", "--layers", str(L), "--out", str(ck), "-q"])
            m = run_cpu([GK, "golden", str(ck), "--out", str(g), "--prompts", str(a.prompts), "--prompt-len",
                         str(a.prompt_len), "--steps", str(a.steps), "--kv", "fp8_e4m3", "-q"], stderr=subprocess.DEVNULL)
            measured["golden"].write_text(json.dumps(m))
        if not measured["verify"].exists():
            if not (out / "manifest.json").exists():
                shutil.rmtree(out, ignore_errors=True)
                run([GK, "compile", str(ROOT / "recipes" / "gpt-oss-120b-trn2.yaml"), "--set", f"source={ck}", "--out",
                     str(out), "--no-compile", "-q"], stdout=subprocess.DEVNULL)
            shutil.rmtree(ck, ignore_errors=True)
            with open(d / f"verify{L}.json", "w") as f:
                m = run_cpu([GK, "verify", str(out), "--golden", str(g), "--json", "-q"], stdout=f)
            measured["verify"].write_text(json.dumps(m))
        shutil.rmtree(ck, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        for kind in rows:
            rows[kind][L] = json.loads(measured[kind].read_text())
        for kind in rows:
            m = rows[kind][L]
            print(f"| {kind} | {L} | {m['wall']:.1f} s | {m['cpu']:.1f} s | {m['wall'] / (L * T):.3f} s | "
                  f"{m['cpu'] / (L * T):.3f} s | {gib(m['rss'])} | {m['load'][0]:.1f} / {m['load'][1]:.1f} |", flush=True)
        rep = json.loads((d / f"verify{L}.json").read_text())
        local = ", ".join(f"{w:.1e} / {m:.1e}" for w, m in zip(rep["layer_local_errors"], rep["layer_local_median"]))
        print(f"|  | verify {L} layers: ok={rep['ok']}, max err {rep['max_abs_err']:.4f}, forced {rep['routing_forced']} "
              f"of {rep['routing_total']}, local error by layer (worst / median) {local}, worst expert "
              f"{max(rep['experts']['worst_by_layer']):.1e}, tail {rep['tail']['norm_error']:.1e} / "
              f"{rep['tail']['lm_head_error']:.1e} | | | | | | |", flush=True)
    if len(a.layers) > 1:
        print(f"\nLinear fit over {a.layers} layers, projected to {MODEL_LAYERS}:")
        total = {"wall": 0.0, "cpu": 0.0}
        for kind, by in rows.items():
            xs = sorted(by)
            for what in ("wall", "cpu"):
                c, s = fit(xs, [by[L][what] for L in xs])
                total[what] += c + s * MODEL_LAYERS
                print(f"- {kind} {what}: {c:.1f} s + {s:.1f} s a layer -> {c + s * MODEL_LAYERS:.0f} s "
                      f"({(c + s * MODEL_LAYERS) / 60:.1f} min)")
            peaks = ", ".join(f"{L} layers {gib(by[L]['rss'])}" for L in xs)
            print(f"- {kind} peak RSS: {peaks}")
        print(f"- golden + verify at {MODEL_LAYERS} layers: wall {total['wall'] / 60:.1f} min, CPU {total['cpu'] / 60:.1f} min")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
