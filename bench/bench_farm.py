"""The compile farm (issue 21): 8 `.pt2` programs on a local Ray cluster against the same 8 one
after another, in one run; the overhead a job costs; a warm-cache farm (planning + verification).

The 8 programs: tiny-cpu with `--vary decode.batch_sizes=[[1,2],[1,4],[1,8],[1,16]]` (each batch
range is a decode and a tail program) crossed with two seeds (new weights are graph inputs: the
seeds add variants, not programs). Sequential: `gkbuild farm --executor local -j 1` into a fresh
folder cache. Ray: a cluster of one node with as many CPUs as the machine (`ray start`, timed
apart), `gkbuild farm --executor ray` into another fresh cache. Warm: the Ray farm again.

Overhead per job = (slots x wall - the jobs' own seconds) / jobs: the slot time not spent inside a
job (process start, imports, scheduling, the cache round trips). The machine is shared: the run
reports how busy it was (CPU seconds of the whole machine against those of this benchmark's
processes, from /proc/stat and the process trees).

    .venv/bin/python bench/bench_farm.py [--dir /tmp/gkbench-farm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, scratch  # noqa: E402
from tests.raycluster import members, ray_cluster  # noqa: E402

GK = str(Path(sys.executable).with_name("gkbuild"))
VARY = ["decode.batch_sizes=[[1, 2], [1, 4], [1, 8], [1, 16]]",
        'source=["synth://tiny?layers=2&seed=0", "synth://tiny?layers=2&seed=1"]']


def machine_cpu() -> float:
    """CPU seconds the whole machine has been busy (every process, every core)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f[:3]) + sum(f[5:8])) / os.sysconf("SC_CLK_TCK")  # user nice system, irq softirq steal


def cluster_cpu(procs: list) -> float:
    """CPU seconds used so far by the Ray cluster's processes (live ones, and those they reaped)."""
    total = 0.0
    for p in members(procs):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except Exception:  # noqa: BLE001 - a worker gone meanwhile
            pass
    return total


def farm(cache: Path, executor: str, env: dict, extra_cpu=lambda: 0.0) -> dict:
    m0, e0 = machine_cpu(), extra_cpu()
    t = time.perf_counter()
    p = subprocess.Popen([GK, "farm", str(ROOT / "recipes" / "tiny-cpu.yaml"), *sum((["--vary", v] for v in VARY), []),
                          "--cache", str(cache), "--executor", executor, "-j", "1", "--json"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    out, err = p.stdout.read(), p.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"farm failed: {err}")
    ours = usage.ru_utime + usage.ru_stime + extra_cpu() - e0
    rep = json.loads(out)
    return {"wall": wall, "report": rep, "ours": ours, "machine": machine_cpu() - m0,
            "job_seconds": sum(j["seconds"] for j in rep["jobs"] if j["status"] == "compiled")}


def main() -> None:
    ap = argparse.ArgumentParser()
    dir_arg(ap, "/tmp/gkbench-farm")
    a = ap.parse_args()
    with scratch(a.dir, cache="gkcache") as d:
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        cores = os.cpu_count() or 1
        seq = farm(d / "seq", "local", env)
        t = time.perf_counter()
        with ray_cluster(nodes=1, cpus=cores, memory_gib=4 * cores) as c:
            started = time.perf_counter() - t
            renv = dict(env, RAY_ADDRESS=c["gcs"])
            ray = farm(d / "ray", "ray", renv, lambda: cluster_cpu(c["procs"]))
            warm = farm(d / "ray", "ray", renv, lambda: cluster_cpu(c["procs"]))
        n = len(seq["report"]["jobs"])
        assert n == 8 and seq["report"]["compiled"] == 8 and ray["report"]["compiled"] == 8, (seq, ray)
        assert warm["report"]["cached"] == 8
        same = all(a_["sha256"] == b["sha256"] for a_, b in zip(seq["report"]["jobs"], ray["report"]["jobs"]))

        def over(r: dict, slots: int) -> float:
            return (slots * r["wall"] - r["job_seconds"]) / n

        print("| run | wall | jobs' own seconds (sum) | overhead a job | CPU s: this run / whole machine |")
        print("|---|---|---|---|---|")
        for name, r, slots in (("8 programs one after another (local, -j 1)", seq, 1),
                               (f"8 programs on local Ray ({cores} CPUs, 1 node)", ray, cores)):
            print(f"| {name} | {r['wall']:.1f} s | {r['job_seconds']:.1f} s | {over(r, slots):.2f} s | "
                  f"{r['ours']:.0f} / {r['machine']:.0f} |")
        print(f"| warm cache (Ray): plan + verify 8 entries | {warm['wall']:.2f} s "
              f"(planning {warm['report']['plan_seconds']:.2f} s) | | | {warm['ours']:.0f} / {warm['machine']:.0f} |")
        print(f"\nRay / sequential: {ray['wall'] / seq['wall']:.2f}x; Ray cluster start (not in the farm's wall): "
              f"{started:.1f} s; archives identical between the two runs: {same}")
        busy = (seq["machine"] + ray["machine"]) / ((seq["wall"] + ray["wall"]) * cores)
        others = 1 - (seq["ours"] + ray["ours"]) / max(seq["machine"] + ray["machine"], 1e-9)
        print(f"machine busy {busy:.0%} of its {cores} cores during the two farms; other processes' share of "
              f"that CPU: {others:.0%}; load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
