"""The negative-test table (issues 12, 18): every fault of tests/faults.py, built into a tiny-cpu
build (bf16 KV, then packed FP8 e4m3fn KV) and verified against the ORIGINAL checkpoint's golden of
the same KV format; the fault's size is the largest logit change it causes in the reference itself
(teacher-forced on the original's tokens). The unused-expert fault runs on synth://tiny-topology
(128 experts, built with the tiny-cpu recipe): its effect is 0 on the golden's prompts and is shown
on other prompts too. Then the smallest effect verify detects: two graded faults (a sink of layer 1
shifted by delta, layer 1's o_proj scaled by 1 + delta) swept upwards.

    .venv/bin/python bench/bench_faults.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gkbench-faults-"))
    os.environ["GKBUILD_CACHE"] = str(tmp / "cache")
    torch.set_num_threads(1)
    from gkbuild import recipe, reference, verify
    from gkbuild.checkpoint.source import materialize, parse
    from gkbuild.golden import default_prompts, for_checkpoint
    from gkbuild.model import preset
    from gkbuild.pipeline.pipeline import compile_build
    from tests import faults

    src = materialize(parse("synth://tiny?layers=2&seed=0"))
    kvs = {"bf16": ([], reference.KvFormat("bf16")),
           "fp8": (["kv_cache.dtype=fp8", "kv_cache.packed=true"], reference.KvFormat("fp8_e4m3fn"))}
    prompts = default_prompts(preset("tiny").V, 4, 4)
    goldens = {k: for_checkpoint(src, prompts, 6, fmt) for k, (_, fmt) in kvs.items()}
    n = [0]

    def effect(edit, kv, base=None, gold=None) -> float | None:
        if edit is None:
            return None
        n[0] += 1
        gold = gold or goldens[kv]
        ck = faults.edit_copy(base or src, tmp / f"ref{n[0]}", edit)
        out = reference.run(ck, gold.token_ids.tolist(), 0, kvs[kv][1])
        return float((out["logits"] - gold.logits).abs().max())

    def caught(fault, source, kv, gold=None):
        n[0] += 1
        out = tmp / f"b{n[0]}"
        with faults.patched(fault):
            compile_build(recipe.load(ROOT / "recipes" / "tiny-cpu.yaml", [f"source={source}", *kvs[kv][0]]),
                          out=out, quiet=True, compile=False)
        return verify.run(out, golden=gold or goldens[kv], other_checkpoint=True)

    def row(f, cells, eff_s):
        print(f"| {f.name} | {f.culprit} | {eff_s} | {cells[0]} | {cells[1]} |", flush=True)

    def cell(rep, f):
        named = rep.culprit or "-"
        right = " (right)" if not rep.ok and rep.culprit and rep.culprit.startswith(f.culprit) else ""
        return f"{'yes' if not rep.ok else 'NO'}, {named}{right}, {rep.max_abs_err:.3f}"

    cat = faults.catalogue(preset("tiny"), faults.kth_expert(goldens["bf16"]))
    print("| fault | part | effect in the reference (max logit change, bf16 / FP8 KV) | bf16 KV: caught, part named, "
          "max err | FP8 KV: caught, part named, max err |")
    print("|---|---|---|---|---|")
    for f in cat:
        n[0] += 1
        source = faults.edit_copy(src, tmp / f"ck{n[0]}", f.edit) if f.edit else src
        cells = [cell(caught(f, source, kv), f) for kv in kvs]
        eff = [effect(f.reference_edit, kv) for kv in kvs]
        row(f, cells, "n/a (no such thing in the model)" if eff[0] is None else f"{eff[0]:.3f} / {eff[1]:.3f}")
    topo = materialize(parse("synth://tiny-topology?layers=2&seed=0"))
    tg = {k: for_checkpoint(topo, default_prompts(preset("tiny-topology").V, 4, 4), 6, fmt) for k, (_, fmt) in kvs.items()}
    other = {k: for_checkpoint(topo, default_prompts(preset("tiny-topology").V, 4, 4, seed=1), 6, fmt)
             for k, (_, fmt) in kvs.items()}
    f = faults.unused_expert_fault(1, faults.unused_experts(tg["bf16"], 1)[0])
    source = faults.edit_copy(topo, tmp / "unused", f.edit)
    cells = [cell(caught(f, source, kv, tg[kv]), f) for kv in kvs]
    eff = [effect(f.edit, kv, topo, tg[kv]) for kv in kvs]
    eff_other = [effect(f.edit, kv, topo, other[kv]) for kv in kvs]
    row(f, cells, f"{eff[0]:.3f} / {eff[1]:.3f} (other prompts: {eff_other[0]:.3f} / {eff_other[1]:.3f})")

    print("\n| graded fault | delta | effect (bf16 / FP8 ref) | caught bf16 | caught FP8 |")
    print("|---|---|---|---|---|")
    p1 = "model.layers.1."
    families = {
        "sink of layer 1 head 0 + delta": lambda dl: {p1 + "self_attn.sinks": faults._f32(lambda a: faults._set(a, 0, a[0] + dl))},
        "o_proj of layer 1 x (1 + delta)": lambda dl: {p1 + "self_attn.o_proj.weight": faults._f32(lambda a: a * (1 + dl))},
    }
    for name, make in families.items():
        for dl in (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5):
            f = faults.Fault(name, 1, make(dl))
            n[0] += 1
            source = faults.edit_copy(src, tmp / f"ck{n[0]}", f.edit)
            res = [caught(f, source, kv) for kv in kvs]
            eff = [effect(f.edit, kv) for kv in kvs]
            marks = [(f"yes, {r.culprit}" + (" (not the logits)" if r.first_failure is None else ""))
                     if not r.ok else "no" for r in res]
            print(f"| {name} | {dl} | {eff[0]:.4f} / {eff[1]:.4f} | {marks[0]} | {marks[1]} |", flush=True)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
