"""The golden's per-expert cost (issue 28): `hf_mxfp4.matmul_t` (transformers' MXFP4 decode, tabulated,
and the product) of one 120b-shaped expert (gate_up 5760 x 2880, then down 2880 x 2880; random block
bytes, scales in 118..122 as `synth` makes them) for 1 and 4 rows, on one thread (as the golden runs an
expert on a worker; the tree before ran its chunks on the pool, at about the same CPU), in this tree and in
`--base TREE` (e.g. `git archive` of the commit before, run with this venv's packages). Each tree runs
in child processes, alternating, `--repeat` times; each child reports the median CPU seconds of 7 calls
and first checks its decode of the gate_up against transformers' `convert_moe_packed_tensors`, bit for bit.

`--twin` (issue 28): the verify's side instead: the kernel twin's eager readers (`kernels.mx.gate_up_rows`
+ `down_rows`) of one 120b-shaped expert's MX tiles (gate_up [128, 2, 6, 3072] u16, down [128, 6, 3072];
random u16s, scales in 118..122) into reused buffers, as `kernels.ahead` reads them, CPU seconds on one
thread; each child first checks the gate_up against the traced readers (`mx.gate_up`), bit for bit.

    .venv/bin/python bench/bench_hf_mxfp4.py --base TREE [--repeat 3] [--twin]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_reference import base_command  # noqa: E402

CHILD = r"""
import json, statistics, time
import numpy as np, torch
torch.set_num_threads(1)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from gkbuild import heap, hf_mxfp4, parallel
heap.reuse_large_blocks()
parallel.WORKERS = 1  # the chunks in this thread, as in the golden (an expert a worker; before: the chunks on the pool)
rng = np.random.default_rng(0)
b, bd = rng.integers(0, 256, (5760, 90, 16), dtype=np.uint8), rng.integers(0, 256, (2880, 90, 16), dtype=np.uint8)
s, sd = rng.integers(118, 123, (5760, 90), dtype=np.uint8), rng.integers(118, 123, (2880, 90), dtype=np.uint8)
want = convert_moe_packed_tensors(torch.from_numpy(b)[None], torch.from_numpy(s)[None], dtype=torch.float32)[0].T
assert torch.equal(torch.from_numpy(hf_mxfp4.dense(b, s)).view(torch.int32), want.contiguous().view(torch.int32))
del want
res = {}
for n in (1, 4):
    x = torch.randn(n, 2880, generator=torch.Generator().manual_seed(n))
    expert = lambda: hf_mxfp4.matmul_t(hf_mxfp4.matmul_t(x, b, s)[:, :2880], bd, sd)
    times = []
    for _ in range(7):
        c = time.process_time(); expert(); times.append(time.process_time() - c)
    res[n] = statistics.median(times)
print(json.dumps(res))
"""

TWIN = r"""
import json, statistics, time
import numpy as np, torch
torch.set_num_threads(1)
from gkbuild import heap
from gkbuild.kernels import mx
heap.reuse_large_blocks()
rng = np.random.default_rng(0)
u16 = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.uint16)
W, S = u16(rng.integers(0, 1 << 16, (128, 2, 6, 3072), dtype=np.uint16)), torch.from_numpy(rng.integers(118, 123, (16, 2, 6, 3072), dtype=np.uint8))
Wd, Sd = u16(rng.integers(0, 1 << 16, (128, 6, 3072), dtype=np.uint16)), torch.from_numpy(rng.integers(118, 123, (16, 6, 3072), dtype=np.uint8))
assert torch.equal(mx.gate_up_rows(W, S).view(torch.int32), mx.gate_up(W, S).transpose(-1, -2).contiguous().view(torch.int32))
gu, down = torch.empty(W.numel() * 4), torch.empty(Wd.numel() * 4)
times = []
for _ in range(7):
    c = time.process_time(); mx.gate_up_rows(W, S, gu); mx.down_rows(Wd, Sd, down); times.append(time.process_time() - c)
print(json.dumps({"decode": statistics.median(times)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the gkbuild tree before the change")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--twin", action="store_true", help="the twin's MX tile readers instead of the golden's")
    a = ap.parse_args()
    base_gk, base_env = base_command(Path(a.base).resolve())
    trees = {"base": ([base_gk[0], "-S"], base_env), "new": ([sys.executable], dict(os.environ))}
    got: dict[str, list[dict]] = {"base": [], "new": []}
    for _ in range(a.repeat):
        for tree, (cmd, env) in trees.items():
            # cwd: ``-c`` puts the working folder first on sys.path, which in this checkout would
            # shadow the base tree (until 2026-12-02 both "trees" ran this one's code)
            out = subprocess.run(cmd + ["-c", TWIN if a.twin else CHILD], env={**env, "OMP_NUM_THREADS": "1"}, check=True,
                                 capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout
            got[tree].append(json.loads(out))
    load = os.getloadavg()[0]
    print(f"one 120b expert (gate_up + down{', the twin decode' if a.twin else ''}), CPU seconds, median of 7 "
          f"a child, {a.repeat} children a tree alternating; load {load:.1f} at the end")
    for n in got["new"][0]:
        best = {t: min(r[n] for r in got[t]) for t in got}
        print(f"- {n}{' row(s)' if n.isdigit() else ''}: base {best['base'] * 1e3:.1f} ms, new {best['new'] * 1e3:.1f} ms "
              f"({best['base'] / best['new']:.2f}x); all: base {[round(r[n] * 1e3, 1) for r in got['base']]}, "
              f"new {[round(r[n] * 1e3, 1) for r in got['new']]}")


if __name__ == "__main__":
    main()
