"""The per-expert costs behind issue 18's choices, at 120b widths (one expert: gate_up 5760 x 2880,
down 2880 x 2880), on a 1-layer `synth gpt-oss-120b` checkpoint and its trn3 build (`--no-compile`).
Each line: the median of 5 (CPU seconds of the process, all its threads), in one process so
the ratios hold on a loaded machine.

- the reference's decode: the build's `checkpoint/mxfp4.decode`, transformers' own
  `convert_moe_packed_tensors` as GPT-OSS loads an expert, and `hf_mxfp4` (that function tabulated)
  with its chunked product for 4 tokens;
- the twin's readers of the MX tiles: the traced nibble readers (`mx.gate_up`/`mx.down`) and the
  u16-table rows readers (`mx.gate_up_rows`/`mx.down_rows`), then a whole expert on 16 rows
  (`decode.expert_forward`);
- each of the twin's with the large temporaries from fresh mappings (glibc's default) and from the
  heap (`heap.reuse_large_blocks`), in two child processes.

    .venv/bin/python bench/bench_levers.py [--dir /tmp/gkbench-levers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, run, scratch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = str(Path(sys.executable).with_name("gkbuild"))

CHILD = r"""
import json, statistics, sys, time
import numpy as np, torch
torch.set_num_threads(1)
from gkbuild import heap, hf_mxfp4
if sys.argv[3] == "heap":
    heap.reuse_large_blocks()
from gkbuild.checkpoint import mxfp4
from gkbuild.checkpoint.reader import Checkpoint
from gkbuild.kernels import decode, mx
from gkbuild.runtime import Build

def t(f, n=5):
    out = []
    for _ in range(n):
        c = time.process_time(); f(); out.append(time.process_time() - c)
    return statistics.median(out)

ck = Checkpoint.open(sys.argv[1])
p = "model.layers.0.mlp.experts."
b, s = (np.array(ck.read(p + "gate_up_proj_" + k, 3, 4))[0] for k in ("blocks", "scales"))
bd, sd = (np.array(ck.read(p + "down_proj_" + k, 3, 4))[0] for k in ("blocks", "scales"))
x4 = torch.randn(4, 2880)
res = {}
if sys.argv[3] == "heap":
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors as hf
    tb, ts, tbd, tsd = (torch.from_numpy(a)[None] for a in (b, s, bd, sd))
    hf_mxfp4.tables()
    res["mxfp4.decode (the build's), one expert"] = t(lambda: (mxfp4.decode(b, s), mxfp4.decode(bd, sd)))
    res["transformers convert_moe_packed_tensors, one expert"] = t(lambda: (hf(tb, ts, dtype=torch.float32),
                                                                          hf(tbd, tsd, dtype=torch.float32)))
    res["hf_mxfp4 tabulated, decode + product for 4 tokens"] = t(lambda: hf_mxfp4.matmul_t(
        hf_mxfp4.matmul_t(x4, b, s)[:, :2880], bd, sd))
bu = Build.open(sys.argv[2], verify="none")
r = bu.load_rank(3)
W, S = r["expert_gate_up_weights"][0, 0], r["expert_gate_up_weights_scale"][0, 0]
Wd, Sd = r["expert_down_weights"][0, 0], r["expert_down_weights_scale"][0, 0]
res["twin traced readers (mx.gate_up + mx.down)"] = t(lambda: (mx.gate_up(W, S), mx.down(Wd, Sd)))
res["twin table readers (mx.gate_up_rows + mx.down_rows)"] = t(lambda: (mx.gate_up_rows(W, S), mx.down_rows(Wd, Sd)))
sc = decode.Scalars.from_manifest(bu.manifest, ep_rank=3)
x16 = torch.randn(16, sc.hidden_padded)
res["twin expert_forward, 16 rows (chunked table readers + products)"] = t(
    lambda: decode.expert_forward(decode.Expert(r, 0, 0, sc), x16, sc))
print(json.dumps(res))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    dir_arg(ap, "/tmp/gkbench-levers")
    a = ap.parse_args()
    with scratch(a.dir) as d:
        ck, out = d / "ck", d / "build"
        run([GK, "synth", "gpt-oss-120b", "--layers", "1", "--out", str(ck), "-q"])
        run([GK, "compile", str(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml"), "--set", f"source={ck}", "--out", str(out),
             "--no-compile", "-q"], stdout=subprocess.DEVNULL)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        got = {}
        for mode in ("mmap", "heap"):
            done = subprocess.run([sys.executable, "-c", CHILD, str(ck), str(out), mode], capture_output=True, text=True,
                                  env=env, check=True)
            got[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; CPU seconds, median of 5")
        print("| what (one 120b expert) | fresh mappings | heap reused |")
        print("|---|---|---|")
        for k, v in got["heap"].items():
            m = got["mmap"].get(k)
            print(f"| {k} | {'' if m is None else f'{m:.3f} s'} | {v:.3f} s |")


if __name__ == "__main__":
    main()
