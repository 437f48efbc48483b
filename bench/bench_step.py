"""One decode step of the tiny model (issue 6): the compiled .pt2 programs against the torch twins
run eagerly and against transformers' eager forward with its KV cache, in one run; and the compile
time of the two programs. Every engine decodes the same tokens from the same prompt, so all three
walk the same context lengths (context .. context + 3 + steps).

    .venv/bin/python bench/bench_step.py [--batch 4] [--context 16] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, scratch  # noqa: E402


def timed(fn, steps: int) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    t = []
    for _ in range(steps):
        s = time.perf_counter()
        fn()
        t.append(time.perf_counter() - s)
    return statistics.median(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    dir_arg(ap, "/tmp/gkbench-step")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        torch.set_num_threads(os.cpu_count() or 1)
        from gkbuild import recipe
        from gkbuild.pipeline.pipeline import compile_build
        from gkbuild.kernels.driver import Session
        from gkbuild.runtime import Build

        # enough KV blocks for 4 sequences x 60 positions (full + sliding blocks)
        res = compile_build(recipe.load(ROOT / "recipes/tiny-cpu.yaml", ["kv_cache.num_blocks=128"]), out=d / "build",
                            quiet=True)
        compile_s = next(s.seconds for s in res.stages if s.name == "compile")
        build = Build.open(d / "build")
        B, T = a.batch, a.context
        prompt = torch.randint(0, 4096, (B, T), generator=torch.Generator().manual_seed(0))
        sessions = {e: Session(build, B, T + a.steps + 3, engine=e) for e in ("compiled", "twin")}
        # the twin keeps dequantized experts between steps; this one re-reads the MX tiles every step,
        # as the compiled program (and the device kernel) does
        sessions["twin, no memo"] = Session(build, B, T + a.steps + 3)
        sessions["twin, no memo"].memo = [None]
        for s in sessions.values():
            for t in range(T):
                s.step(prompt[:, t])

        def stepper(s):
            tok = prompt[:, 0]
            return lambda: s.step(tok)

        times = {e: timed(stepper(s), a.steps) for e, s in sessions.items()}
        # transformers: the same model, one new token a step with its KV cache, eager
        from transformers import GptOssForCausalLM, Mxfp4Config
        import transformers

        transformers.utils.logging.set_verbosity_error()
        from gkbuild.checkpoint.source import materialize, parse

        model = GptOssForCausalLM.from_pretrained(str(materialize(parse("synth://tiny?layers=2&seed=0"))),
                                                  quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            cache = out.cache
            nxt = out.logits[:, -1:].argmax(-1)

            def hf_step():
                model(nxt, cache=cache, use_cache=True)

            times["transformers"] = timed(hf_step, a.steps)
        names = ["compiled", "twin, no memo", "twin", "transformers"]
        print(f"| batch {B}, context {T} | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        print("| one decode step | " + " | ".join(f"{times[n] * 1e3:.2f} ms" for n in names) + " |")
        print("| ratio to compiled | " + " | ".join(f"{times[n] / times['compiled']:.2f}x" for n in names) + " |")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"\npeak RSS of this process (all four engines loaded): {peak:.2f} GiB")
        print(f"compile time (decode + tail programs, AOTInductor, cpu): {compile_s:.1f} s")


if __name__ == "__main__":
    main()
