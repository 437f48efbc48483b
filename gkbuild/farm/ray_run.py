"""The Ray executor: each job a Ray task asking for the recipe's CPUs and memory
(``compile.job_cpus`` / ``compile.job_memory_gib``).

Ray's behaviour this relies on, from ray 2.60.0's source (the wheel of
ray-project/ray@b7f4259e944bf6959f721b106adc366ddfa0c356, its ``python/ray/`` files):
- a task whose worker process dies is rerun up to ``max_retries`` times
  (python/ray/remote_function.py:244; doc/source/ray-core/fault_tolerance/tasks.rst, "Retrying
  failed tasks", at ray-project/ray@d78dbf5f350a4d50b8338562026c05fcd2ea97f7); an exception the
  job raises is not retried (``retry_exceptions`` False, remote_function.py:252): a compile error
  is the same on every attempt;
- ``num_cpus`` and ``memory`` (bytes, remote_function.py:233) are logical resource requests: a
  task is scheduled only on a node with that much unreserved;
- ``ray.cancel(ref, force=True)`` kills a running task's worker and drops a pending one; cancelled
  tasks are not retried (python/ray/_private/worker.py:3518);
- while a task runs, its worker's process title is ``ray::<task name>``
  (python/ray/_private/worker.py:2850, ``_changeproctitle``): the task names its program and key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

from ..errors import GkError
from . import job as jobs_mod
from .plan import Job


def _task(job: Job, cache_uri: str) -> dict:
    """What runs on a Ray worker: the job, with the node and process it ran in."""
    import ray

    where = f"{socket.gethostname()} node {ray.get_runtime_context().get_node_id()[:8]} pid {os.getpid()}"
    return jobs_mod.run(job, cache_uri, where)


def task_name(job: Job) -> str:
    return f"gkbuild-farm {job.program} {job.key[:12]}"


def run(jobs: list[Job], cache_uri: str, address: str | None, retries: int, on_done) -> None:
    """Run ``jobs`` on the Ray cluster at ``address`` (None: Ray's own lookup: ``RAY_ADDRESS``, a
    cluster started on this machine, else a new local one); ``on_done(job, result)`` as each
    ends. Ctrl-C cancels every task not yet done."""
    with session(address) as ray:
        remote = ray.remote(_task)
        refs = {remote.options(name=task_name(j), num_cpus=j.cpus, memory=j.memory, max_retries=retries,
                               retry_exceptions=False).remote(j, cache_uri): j for j in jobs}
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                for ref in done:
                    on_done(refs[ref], _result(ray, ref, refs[ref], retries))
        except BaseException:
            cancel(ray, pending)
            raise


@contextlib.contextmanager
def session(address: str | None):
    """Ray, connected to the cluster at ``address`` for the block, then disconnected. Ray's driver
    prints the cluster's error reports ("(raylet) A worker died...") with print(): they go to
    stderr, so stdout stays the report (--json)."""
    try:
        import ray
    except ImportError:
        raise GkError("--executor ray: Ray is not installed; pip install 'gkbuild[farm]'") from None
    with contextlib.redirect_stdout(sys.stderr):
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise GkError(f"--executor ray: cannot reach a Ray cluster at {address or 'RAY_ADDRESS/local'}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        try:
            yield ray
        finally:
            ray.shutdown()


def cancel(ray, refs) -> None:
    """Stop the tasks not yet done: a running one's worker is killed, a pending one dropped."""
    for ref in refs:
        ray.cancel(ref, force=True)


def _result(ray, ref, job: Job, retries: int) -> dict:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else e
        return jobs_mod.failed(job, str(cause) or type(cause).__name__)
    except ray.exceptions.WorkerCrashedError:
        return jobs_mod.failed(job, f"its worker died on each of {retries + 1} attempts")
    except ray.exceptions.RayError as e:
        return jobs_mod.failed(job, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
