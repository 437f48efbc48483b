"""A real Ray cluster on 127.0.0.1 (a head and worker nodes, each a `ray start --block` of its own),
for the tests and the benchmarks.

Small on purpose (a shared 2-core machine): one CPU and a few GiB of logical memory a node, a
100 MiB object store, no dashboard, no usage stats, its own temp folder and free ports. Stopped by
killing exactly the processes it started (each `ray start` and every process under it), never
with `ray stop`, which would stop every Ray cluster on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def ray_env() -> dict:
    return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
                RAY_memory_monitor_refresh_ms="0")


class StartFailed(RuntimeError):
    """A `ray start` exited, or the cluster did not come up, before it was handed out."""


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 1, memory_gib: float = 4.0) -> Iterator[dict]:
    """Start a head and ``nodes - 1`` worker nodes; yields {"gcs": HOST:PORT, "client":
    ray://HOST:PORT, "procs": the `ray start` processes, "temp": the cluster's temp folder}. The
    environment (AWS endpoint of a test S3 server, GKBUILD_CACHE...) is the workers' environment.

    A start that fails is tried once more, with fresh ports and folder, and said as a warning with
    what `ray start` printed: on a loaded 2-core machine the head has exited while its nodes came up
    (once in a clean clone's full suite)."""
    with contextlib.ExitStack() as stack:
        for attempt in (1, 2):
            try:
                cluster = stack.enter_context(_cluster(nodes, cpus, memory_gib))
                break
            except StartFailed as e:
                if attempt == 2:
                    raise
                warnings.warn(f"the Ray cluster did not start, trying once more: {e}", stacklevel=3)
        yield cluster


@contextlib.contextmanager
def _cluster(nodes: int, cpus: int, memory_gib: float) -> Iterator[dict]:
    import psutil

    temp = tempfile.mkdtemp(prefix="gkray", dir="/tmp")  # short: Ray's unix sockets live under it
    gcs, client = free_port(), free_port()
    common = ["--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", f"--memory={int(memory_gib * 2**30)}",
              f"--object-store-memory={100 << 20}", "--block", "--disable-usage-stats"]
    procs: list[subprocess.Popen] = []
    started: set[int] = set()

    def spawn(args: list[str]) -> None:
        with open(Path(temp) / f"ray-start-{len(procs)}.log", "wb") as log:  # why one exits, if it does
            p = subprocess.Popen([RAY, "start", *args, *common], env=ray_env(), stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)

    def descendants() -> None:
        started.update(p.pid for p in members(procs))

    try:
        spawn(["--head", f"--port={gcs}", f"--ray-client-server-port={client}", "--include-dashboard=false",
               f"--temp-dir={temp}"])
        deadline = time.monotonic() + 120
        while not (_up(gcs) and _up(client)):
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise StartFailed(f"the Ray head did not start: {_said(temp, procs)}")
            time.sleep(0.2)
        for _ in range(nodes - 1):
            spawn([f"--address=127.0.0.1:{gcs}"])
        _wait_for_nodes(f"127.0.0.1:{gcs}", nodes, procs, temp)
        descendants()
        yield {"gcs": f"127.0.0.1:{gcs}", "client": f"ray://127.0.0.1:{client}", "procs": procs, "temp": temp}
    finally:
        descendants()
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for pid in started | {p.pid for p in procs}:  # whatever outlived its `ray start`
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        shutil.rmtree(temp, ignore_errors=True)


def members(procs: list[subprocess.Popen]) -> list:
    """Every live process of the cluster: those in the sessions its `ray start` processes lead (Ray
    daemonizes the raylet and GCS out from under `ray start`; they keep its session), and their
    descendants."""
    import psutil

    sids = {p.pid for p in procs}
    out = {}
    for q in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            if os.getsid(q.pid) in sids:
                out[q.pid] = q
                out.update((c.pid, c) for c in q.children(recursive=True))
    return list(out.values())


def _said(temp: str, procs: list) -> str:
    """The last lines each `ray start` that exited printed."""
    out = []
    for i, p in enumerate(procs):
        if p.poll() is not None:
            with contextlib.suppress(OSError):
                tail = (Path(temp) / f"ray-start-{i}.log").read_text(errors="replace").strip().splitlines()[-15:]
                out.append(f"`ray start` #{i} exited {p.returncode}:\n" + "\n".join(tail))
    return "\n".join(out) or "(no `ray start` has exited)"


def _wait_for_nodes(address: str, n: int, procs: list, temp: str) -> None:
    """Until the cluster reports ``n`` live nodes (asked from a short-lived driver process)."""
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
             "print(sum(x['Alive'] for x in ray.nodes()))")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise StartFailed(f"a `ray start` exited early: {_said(temp, procs)}")
        r = subprocess.run([sys.executable, "-c", probe, address], env=ray_env(), capture_output=True, text=True,
                           timeout=120)
        if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        time.sleep(1)
    raise StartFailed(f"the Ray cluster did not reach {n} nodes")


def running_tasks(name_prefix: str) -> list:
    """The worker processes now running a task whose name starts with ``name_prefix`` (Ray titles a
    busy worker ``ray::<task name>``)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith(f"ray::{name_prefix}"):
            out.append(p)
    return out
