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
