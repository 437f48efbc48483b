"""The shared chunk pool (gkbuild.parallel)."""

import threading

from gkbuild import parallel


def test_a_call_from_a_worker_runs_its_items_in_that_worker():
    """The reference runs its experts on the pool and each expert's chunks through parallel.each again:
    those run in the worker's own thread (a worker waiting on items queued behind it would hang), in order."""
    def outer(i: int):
        return threading.get_ident(), parallel.each(lambda j: (threading.get_ident(), i * 10 + j), range(4))

    for i, (me, inner) in enumerate(parallel.each(outer, range(2 * parallel.WORKERS))):
        assert inner == [(me, i * 10 + j) for j in range(4)]


def test_a_forked_child_of_a_process_with_a_pool_runs_its_chunks():
    """The build forks its emission workers from a process whose pool may already be running (a
    verify or a reference before it, as in the test suite's workers); a child handed the parent's
    pool, whose threads it does not have, would hang on its first chunk list (a dense source's
    experts are quantized on the pool in those workers)."""
    import multiprocessing as mp

    assert parallel.each(abs, [-1, -2]) == [1, 2]  # the parent's pool is up
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_chunks_in_child)
    child.start()
    child.join(60)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung and child.exitcode == 0


def _chunks_in_child() -> None:
    threads = {threading.get_ident()}

    def double(x: int) -> int:
        threads.add(threading.get_ident())
        return x * 2

    out = parallel.each(double, range(8))
    assert out == [x * 2 for x in range(8)]
    assert parallel.WORKERS == 1 or len(threads) > 1  # on the child's own pool, not inline
