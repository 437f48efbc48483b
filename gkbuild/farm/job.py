"""One farm job: trace and compile one program from the recipe and the model config alone (no
weights, no build folder), then push it to the compile cache.

A job works in a folder of its own, ``$TMPDIR/gkbuild-farm-<uid>/<key[:16]>``, held under that
key's lock: it never writes into another job's output, and a job of the same key on the same
host (another farm, a Ray retry) waits, then finds the program in the cache. What a killed
attempt left there is removed by the next. The push is conditional (the entry is created only if
absent), as every push to a compile cache is.

Run as ``python -m gkbuild.farm.job JOB.json RESULT.json CACHE`` by the local executor.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from ..errors import GkError
from .plan import Job


def result(job: Job, status: str, where: str, seconds: float = 0.0, **more) -> dict:
    return {**job.summary(), "status": status, "where": where, "seconds": round(seconds, 2), **more}


@contextmanager
def work_folder(key: str):
    """This job's own folder (emptied first, removed after), under its key's lock."""
    from ..paths import file_lock

    base = Path(tempfile.gettempdir()) / f"gkbuild-farm-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    if os.path.islink(base) or base.stat().st_uid != os.getuid():
        raise GkError(f"{base}: is a symlink or not ours; refusing to work in it")
    work = base / key[:16]
    with file_lock(base / f"{key[:16]}.lock"):
        if os.path.islink(work):
            raise GkError(f"{work}: is a symlink; refused")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(mode=0o700)
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)


def run(job: Job, cache_uri: str, where: str | None = None) -> dict:
    """Compile ``job``'s program and push it to ``cache_uri``: the job's result (status compiled,
    or cached when another job pushed it first; start and end as wall-clock times)."""
    from .. import recipe as rc
    from ..compile import signature, stage
    from ..compile.cache import CompileCache
    from ..model import GptOssConfig
    from ..plan import make_plan

    start = time.time()
    where = where or f"{socket.gethostname()} pid {os.getpid()}"
    r = rc.loads(job.recipe_text, Path(job.recipe_path), list(job.overrides))
    p = make_plan(r, GptOssConfig.from_hf(job.config, f"{job.program}: the planner's model config"))
    be = stage.backend(p)
    sig = next((s for s in signature.programs(p) if s.key == job.program), None)
    if sig is None:
        raise GkError(f"{job.recipe_path}: plans no program {job.program} here")
    k = stage.program_keys(p, be, [sig])[sig.key]
    if k != job.key:
        differ = sorted(set(be.flags[sig.program]) ^ set(job.expect.get("flags") or []))
        raise GkError(f"{job.program}: this host's gkbuild and compiler make compile key {k[:16]}, the planner's "
                      f"made {job.key[:16]}; run the same gkbuild and compiler versions on both"
                      + (f", on the same kind of machine (flags {', '.join(differ)})" if differ else ""))
    with work_folder(k) as work:
        cache = CompileCache(cache_uri, push=True, staging=work / "staging")
        if cache.holds(k, sig.key, job.expect):
            return result(job, "cached", where, time.time() - start, start=start, end=time.time())
        path = stage.compile_program(p, sig, be, work, k)
        entry = stage.artifact_entry(p, sig, be, work, stage.artifact_path(be, sig))
        if not cache.push(k, sig.key, path, entry) and not CompileCache(cache_uri).holds(k, sig.key, job.expect):
            raise GkError(f"{job.program}: compiled but not pushed: {cache_uri} holds an entry of key {k[:16]} "
                          f"that does not verify (gkbuild cache prune {cache_uri} removes it)")
    end = time.time()
    return result(job, "compiled", where, end - start, start=start, end=end, sha256=entry["sha256"])


def failed(job: Job, why: str, where: str = "") -> dict:
    return result(job, "failed", where, error=why.splitlines()[0] if why else "(no message)")


def main(argv: list[str]) -> int:
    """The local executor's job process: JOB.json in, RESULT.json out; a failure is one line on
    stderr and exit status 1."""
    spec, out, cache_uri = argv
    job = Job(**{k: tuple(v) if k in ("recipes", "overrides") else v
                 for k, v in json.loads(Path(spec).read_text()).items()})
    try:
        res = run(job, cache_uri)
    except (GkError, OSError) as e:
        from ..errors import os_error

        print(f"gkbuild: error: {e if isinstance(e, GkError) else os_error(e)}", file=sys.stderr)
        return 1
    Path(out).write_text(json.dumps(res))
    return 0


def to_json(job: Job) -> str:
    return json.dumps(asdict(job))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
