"""DI transfer (issue 19): NIXL READ throughput of a 120b-shaped per-rank KV against a plain
in-process memcpy of the same bytes (one run, alternating), and the transfer plan's size and build
time at 128 ranks.

    .venv/bin/python bench/bench_di.py [--blocks 2048] [--repeat 3]

One decode rank of gpt-oss-120b-trn3 (stacked, packed FP8, block 128 x d 64, 1 kv head) pulls
every block of every layer's K and V from prefill rank 0 of a TP4 engine (2 kv heads a block,
seed 000's per-buffer layout) in another process, over UCX/TCP on 127.0.0.1, as the plan's
descriptors say (one 8 KiB head slice of a 16 KiB prefill block each). The memcpy copies the same
number of bytes, contiguous, in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gkbuild.di import nixl, wire  # noqa: E402
from gkbuild.di.plan import descriptors, transfer_plan  # noqa: E402


def kv_doc(blocks: int | None = None) -> dict:
    """kv.json of the 120b trn3 recipe (its own num_blocks, or ``blocks``)."""
    from gkbuild import recipe
    from gkbuild.model import preset
    from gkbuild.pipeline.pipeline import layout_docs
    from gkbuild.plan import make_plan

    sets = [f"kv_cache.num_blocks={blocks}"] if blocks else []
    p = make_plan(recipe.load(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml", sets), preset("gpt-oss-120b"))
    return json.loads(json.dumps(layout_docs(p)["layout/kv.json"]))


def serve(blocks: int) -> None:
    """The prefill side: rank 0's 18 buffers [2, blocks, 2, 128, 64] fp8 registered, filled with
    bytes, progressed until the reader says done."""
    bufs = [torch.randint(0, 255, (2, blocks, 2, 128, 64), dtype=torch.uint8) for _ in range(18)]
    halves = [b[h] for b in bufs for h in (0, 1)]
    a = nixl.agent(f"bench-prefill-{os.getpid()}")
    a.register_memory(halves)
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    print(f"READY {ls.getsockname()[1]}", flush=True)
    conn, _ = ls.accept()
    wire.send(conn, {"op": "hello", "agent": a.name, "metadata": wire.b64(a.get_agent_metadata()),
                     "regions": [t.data_ptr() for t in halves]})
    import select

    while not select.select([conn], [], [], 0.001)[0]:
        nixl.progress([a])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve is not None:
        return serve(a.serve)
    torch.set_num_threads(1)

    # the plan at 128 ranks (the recipe's own 14,563 blocks): build time and size
    doc = kv_doc()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        plan = transfer_plan(doc, 4, 128)
        times.append(time.perf_counter() - t)
    size = len(json.dumps(plan).encode())
    print(f"plan: {len(plan['ranks'])} ranks x {len(plan['ranks'][0]['reads'])} reads, {size} bytes of JSON, "
          f"built in {statistics.median(times) * 1e3:.1f} ms (median of 5)")

    # one decode rank's whole KV of --blocks blocks, read from prefill rank 0
    nb = a.blocks
    plan = transfer_plan(kv_doc(nb), 4, 128)
    ids = np.arange(nb, dtype=np.int64)
    pairs = {g: np.stack([ids, ids], axis=1) for g in ("full", "swa")}
    t = time.perf_counter()
    d = descriptors(plan, 1, pairs)  # rank 1: kv head 1, the second head of prefill rank 0's blocks
    built = time.perf_counter() - t
    assert (d[:, 2] == 0).all()
    K = torch.zeros(36, nb, 1, 128, 64, dtype=torch.uint8)
    V = torch.zeros_like(K)
    total = K.numel() * 2
    assert int(d[:, 5].sum()) == total

    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(nb)], stdout=subprocess.PIPE)
    line = b""
    while not line.startswith(b"READY"):
        line = proc.stdout.readline()
    s = socket.create_connection(("127.0.0.1", int(line.split()[1])))
    hello = wire.recv(s, "bench prefill")
    ag = nixl.agent(f"bench-decode-{os.getpid()}")
    reg = ag.register_memory([K, V])
    name = ag.add_remote_agent(wire.unb64(hello["metadata"], "metadata"))
    name = name.decode() if isinstance(name, bytes) else name
    base = np.array([K.data_ptr(), V.data_ptr()], dtype=np.int64)
    regions = np.array(hello["regions"], dtype=np.int64)
    local = np.stack([base[d[:, 0]] + d[:, 1], d[:, 5]], axis=1)
    remote = np.stack([regions[d[:, 3]] + d[:, 4], d[:, 5]], axis=1)
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst = torch.empty_like(src)

    def pull() -> float:
        t = time.perf_counter()
        r = nixl.Reads(ag)
        r.post(name, local, remote)
        r.wait(600)
        return time.perf_counter() - t

    def memcpy() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t

    pull(), memcpy()  # warm: connection, page faults
    tn, tm = [], []
    for _ in range(a.repeat):
        tn.append(pull())
        tm.append(memcpy())
    n, m = statistics.median(tn), statistics.median(tm)
    gib = total / 2**30
    print(f"per-rank KV: {nb} blocks x 36 layers x K/V = {gib:.2f} GiB in {len(d)} descriptors of 8 KiB "
          f"(built from the plan in {built * 1e3:.0f} ms)")
    print(f"NIXL READ (UCX/TCP, 127.0.0.1): {n:.2f} s = {gib / n:.2f} GiB/s; memcpy: {m:.3f} s = {gib / m:.2f} GiB/s; "
          f"memcpy / NIXL = {n / m:.1f}x (medians of {a.repeat}, alternating)")
    ag.remove_remote_agent(name)
    ag.deregister_memory(reg)
    s.close()
    proc.wait(timeout=30)


if __name__ == "__main__":
    main()
