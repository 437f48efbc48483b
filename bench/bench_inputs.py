"""What the input checks of issue 27 (items 3, 5, 7, 12) cost, each ratio against a baseline measured
in the same run, baseline and candidate alternating.

(a) strict JSON (no overflowing number, no key twice: ``jsonio.loads``) against the reading it
    replaced (``json.loads`` refusing NaN, then the depth walk), on the 128-rank tiny-topology
    manifest and on the 120b preset's synthesized tokenizer.json;
(b) ``Build.open`` of the 128-rank tiny-topology build, layouts checked whole, against the same
    open with the layout checks skipped (``layout.validate`` stubbed), verify="none";
(c) ``text.encode(chat=True)``: the chat template rendered in a bounded forked child, against
    transformers' ``apply_chat_template`` in process (both then tokenize the same text).

    .venv/bin/python bench/bench_inputs.py [--repeat 5] [--dir /tmp/gkbench-inputs]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, scratch  # noqa: E402


def alternate(base, cand, repeat: int) -> tuple[float, float]:
    """Medians of ``base`` and ``cand``, run in turns."""
    b, c = [], []
    for _ in range(repeat):
        for fn, out in ((base, b), (cand, c)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(b), statistics.median(c)


def row(what: str, base_name: str, b: float, c: float) -> None:
    print(f"| {what} | {base_name} {b * 1e3:.1f} ms | {c * 1e3:.1f} ms | {c / b:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    dir_arg(ap, "/tmp/gkbench-inputs")
    a = ap.parse_args()
    with scratch(a.dir, remove=False) as work:
        from gkbuild import jsonio, recipe, text
        from gkbuild.checkpoint import synth_tokenizer
        from gkbuild.checkpoint.source import parse
        from gkbuild.layout import validate
        from gkbuild.model import preset
        from gkbuild.pipeline.pipeline import compile_build
        from gkbuild.runtime import Build

        out = work / "topo"
        compile_build(recipe.load(ROOT / "recipes" / "tiny-topology-trn3.yaml"), out=out, quiet=True, compile=False)
        tok_json, _ = synth_tokenizer.build(preset("gpt-oss-120b"))
        print(f"uptime: {os.popen('uptime').read().strip()}")
        print("| what | baseline | measured | ratio |\n|---|---|---|---|")

        def old(data):
            return lambda: jsonio.depth_problem(json.loads(data, parse_constant=jsonio._refuse_constant))

        def new(data):
            return lambda: jsonio.loads(data, "bench")

        man = (out / "manifest.json").read_bytes()
        row(f"(a) parse the 128-rank manifest ({len(man) >> 10} KiB)", "former reader",
            *alternate(old(man), new(man), a.repeat))
        tj = tok_json.encode()
        row(f"(a) parse the 120b preset's tokenizer.json ({len(tj) >> 10} KiB)", "former reader",
            *alternate(old(tj), new(tj), a.repeat))

        real = validate.kv, validate.tail

        def open_build(check: bool):
            def run():
                validate.kv, validate.tail = real if check else (lambda doc, m, root: None, lambda doc, m, root: None)
                b = Build.open(out, verify="none")
                b.close()
                validate.kv, validate.tail = real
            return run
        row("(b) `Build.open`, 128 ranks, layouts checked whole", "layout checks skipped",
            *alternate(open_build(False), open_build(True), a.repeat))

        tok = text.tokenizer(parse("synth://tiny"))
        prompt = "The capital of France is"

        def in_process():
            tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        row("(c) `text.encode(chat=True)`, one prompt, bounded forked child", "`apply_chat_template` in process",
            *alternate(in_process, lambda: text.encode(tok, [prompt], chat=True), a.repeat))
        print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB; "
              f"of a render child: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
