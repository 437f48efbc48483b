"""``gkbuild farm``: plan, skip what the cache holds, run the rest on an executor, report."""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import GkError, shown
from ..progress import steps_bar
from .job import result
from .plan import Job, missing, plan, select

EXECUTORS = "local, ray, or ray://HOST:PORT"


def parse_executor(text: str) -> tuple[str, str | None]:
    """``local`` | ``ray`` (Ray's own lookup: RAY_ADDRESS, a cluster on this machine, else a new
    local one) | ``ray://HOST:PORT`` (a Ray cluster's client address) -> (kind, address)."""
    if text in ("local", "ray"):
        return text, None
    if text.startswith("ray://") and len(text) > len("ray://"):
        return "ray", text
    raise GkError(f"--executor {shown(text)}: expected {EXECUTORS}")


def run(recipe_paths: list[Path], cache_uri: str, overrides: list[str] = (), vary: list[str] = (),
        executor: str = "local", workers: int = 1, retries: int = 2, list_only: bool = False,
        only: str | None = None, quiet: bool = False) -> dict:
    """Plan every program of ``recipe_paths`` x ``vary``, skip those ``cache_uri`` holds, compile
    the rest (``only``: just the job of that key) and push them; the report: one row a job."""
    from ..compile.cache import CompileCache

    kind, address = parse_executor(executor)
    t0 = time.perf_counter()
    jobs = plan(recipe_paths, overrides, vary)
    if only:
        jobs = [select(jobs, only)]
    todo = missing(jobs, CompileCache(cache_uri))
    todo_keys = {j.key for j in todo}
    results = {j.key: result(j, "cached", "cache") for j in jobs if j.key not in todo_keys}
    planned = time.perf_counter() - t0
    report = {"cache": cache_uri, "executor": executor, "planned": len(jobs), "plan_seconds": round(planned, 3)}
    if list_only:
        return {**report, "jobs": [result(j, "missing", "") for j in todo]}
    with steps_bar(f"farm: {len(todo)} programs to compile ({kind})", len(todo), quiet) as advance:
        def on_done(job: Job, res: dict) -> None:
            results[job.key] = res
            advance(1, f"{job.program} {res['status']}")

        if todo and kind == "local":
            from . import local

            local.run(todo, cache_uri, workers, on_done)
        elif todo:
            from . import ray_run

            ray_run.run(todo, cache_uri, address, retries, on_done)
    rows = [results[j.key] for j in jobs]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("compiled", "cached", "failed")}
    return {**report, **counts, "seconds": round(time.perf_counter() - t0, 3), "jobs": rows}
