"""``--scratch-limit`` of a command that reads its inputs by range (verify of a store, golden): the
local disk it adds under $GKBUILD_CACHE and $TMPDIR, sampled as it runs (``pipeline.stream.DiskWatch``)."""

from __future__ import annotations

import tempfile
from pathlib import Path


def within(limit: int, what: str, work):
    """``work()``'s result, the local disk it adds sampled as it runs; one line naming ``what`` if
    that passed ``limit``. (result, the peak bytes it added)."""
    from .checkpoint.source import cache_root
    from .errors import GkError
    from .pipeline.stream import DiskWatch
    from .summary import human_bytes

    roots = [p for p in (cache_root(), Path(tempfile.gettempdir())) if p.is_dir()]
    with DiskWatch(*roots) as disk:
        before = disk.peak
        out = work()
    if disk.peak - before > limit:
        raise GkError(f"--scratch-limit {human_bytes(limit)}: the {what} took {human_bytes(disk.peak - before)} "
                      f"of local disk")
    return out, disk.peak - before
