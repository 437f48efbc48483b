"""The local executor: each job in a process of its own (``python -m gkbuild.farm.job``), at most
``workers`` at once. A job's process starts fresh (no compiler state carried between programs);
Ctrl-C terminates the running ones and starts no more."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import job as jobs_mod
from .plan import Job


def run(jobs: list[Job], cache_uri: str, workers: int, on_done) -> None:
    """Run ``jobs``; ``on_done(job, result)`` as each ends (``result["status"]`` compiled, cached or
    failed)."""
    todo = list(jobs)
    running: dict[subprocess.Popen, tuple[Job, Path, float]] = {}  # stderr goes to RESULT.err
    tmp = Path(tempfile.mkdtemp(prefix="gkbuild-farm-"))
    try:
        while todo or running:
            while todo and len(running) < workers:
                j = todo.pop(0)
                spec, out = tmp / f"{j.key[:16]}.job.json", tmp / f"{j.key[:16]}.result.json"
                spec.write_text(jobs_mod.to_json(j))
                with open(out.with_suffix(".err"), "w") as err:
                    p = subprocess.Popen([sys.executable, "-m", "gkbuild.farm.job", str(spec), str(out), cache_uri],
                                         stdout=subprocess.DEVNULL, stderr=err)
                running[p] = (j, out, time.monotonic())
            time.sleep(0.05)
            for p in [p for p in running if p.poll() is not None]:
                j, out, t0 = running.pop(p)
                err = out.with_suffix(".err").read_text(errors="replace")
                where = f"{socket.gethostname()} pid {p.pid}"
                if p.returncode == 0 and out.exists():
                    on_done(j, jobs_mod.json.loads(out.read_text()))
                else:
                    said = [ln for ln in err.splitlines() if ln.startswith("gkbuild: error: ")]
                    why = said[-1].removeprefix("gkbuild: error: ") if said else \
                        (err.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
                    on_done(j, jobs_mod.failed(j, why, where) | {"seconds": round(time.monotonic() - t0, 2)})
    finally:
        for p in running:
            p.terminate()
        for p in running:
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
