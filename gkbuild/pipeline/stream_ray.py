"""``gkbuild compile --to STORE --executor ray``: each shard job a Ray task that reads its own
source ranges, stages its shard on its node (under that node's ``$GKBUILD_CACHE``) and sends its
blob; the driver plans, collects the records and commits.

Ray's behaviour relied on is the farm's (``farm.ray_run``, from ray 2.60.0's source): a task whose
worker dies is rerun up to ``max_retries`` times; an exception a job raises is not retried
(``retry_exceptions`` False: a bad source fails the same way each time); ``ray.cancel(ref,
force=True)`` kills a running task. A killed task's blob is content-named and in no index (an S3
multipart upload it began is resumed by its retry; LFS content it sent to the hub is in no commit),
so a lost worker leaves nothing visible.
"""

from __future__ import annotations

from ..errors import GkError
from ..farm.ray_run import cancel, session
from ..farm.run import parse_executor
from .stream import StreamJob, run_stream_shard

RETRIES = 2


def task_name(sj: StreamJob) -> str:
    return f"gkbuild-stream {sj.name}"


def run(jobs: list[StreamJob], executor: str, budget: int, on_done, retries: int = RETRIES) -> None:
    """The jobs as Ray tasks, as many in flight as their staging fits ``budget``; ``on_done(job,
    record)`` as each ends. The first failure cancels the rest and is raised."""
    _, address = parse_executor(executor)
    with session(address) as ray:
        remote = ray.remote(run_stream_shard)
        queue, pending, used = list(jobs), {}, 0
        try:
            while queue or pending:
                while queue and (not pending or used + queue[0].staging <= budget):
                    sj = queue.pop(0)
                    ref = remote.options(name=task_name(sj), num_cpus=1, max_retries=retries,
                                         retry_exceptions=False).remote(sj)
                    pending[ref] = sj
                    used += sj.staging
                done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in done:
                    sj = pending.pop(ref)
                    used -= sj.staging
                    on_done(sj, _result(ray, ref, sj, retries))
        except BaseException:
            cancel(ray, pending)
            raise


def _result(ray, ref, sj: StreamJob, retries: int) -> dict:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else e
        if isinstance(cause, GkError):
            raise GkError(str(cause)) from None
        raise GkError(f"{sj.name}: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}") \
            from None
    except ray.exceptions.WorkerCrashedError:
        raise GkError(f"{sj.name}: its Ray worker died on each of {retries + 1} attempts") from None
    except ray.exceptions.RayError as e:
        raise GkError(f"{sj.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
