"""The one reader of every JSON document gkbuild reads back: state and fingerprint records, fetch
records, store indexes, manifests, config/index/safetensors headers, golden metadata, the S3
mirror's record, compile-cache entries, signatures and provenance.

Such a file is data from a disk or a store, possibly hostile: its size is bounded before it is
read, its nesting before anything walks it (``[[[[...`` 200,000 deep would otherwise end in a
RecursionError traceback here or in whatever recurses over it later), and it is strict JSON (no
NaN or Infinity). Every failure is one ``BadJson`` line naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import GkError

MAX_DEPTH = 64  # the deepest document gkbuild writes is a manifest, about 8 levels


class BadJson(GkError, ValueError):
    """A JSON document that is too big, too deep, not strict JSON, or not JSON at all."""


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def depth_problem(obj, limit: int = MAX_DEPTH) -> str | None:
    """Why ``obj`` (parsed JSON or YAML) nests too deeply, or None; walked without recursion."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        children = o.values() if isinstance(o, dict) else o if isinstance(o, list) else ()
        for c in children:
            if isinstance(c, (dict, list)):
                if d + 1 > limit:
                    return f"nested deeper than {limit} levels"
                stack.append((c, d + 1))
    return None


def loads(data: bytes | str, where: str, limit: int | None = None):
    """Parse ``data``: at most ``limit`` bytes, nested at most MAX_DEPTH deep, strict."""
    if limit is not None and len(data) > limit:
        raise BadJson(f"{where}: over {limit} bytes; refused unread")
    try:
        obj = json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise BadJson(f"{where}: nested deeper than {MAX_DEPTH} levels; refused") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
        raise BadJson(f"{where}: not valid JSON ({str(e)[:100]})") from None
    why = depth_problem(obj)
    if why:
        raise BadJson(f"{where}: {why}; refused")
    return obj


def read_bounded(path: Path, limit: int, where: str | None = None) -> bytes:
    """At most ``limit`` bytes of the file at ``path`` (a bigger one is refused, not read whole)."""
    where = where or str(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise BadJson(f"{where}: {os.fstat(f.fileno()).st_size} bytes, over the {limit} such a file can be; "
                          f"refused unread")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BadJson(f"{where}: over {limit} bytes; refused")
    return data


def read(path: Path, limit: int, where: str | None = None):
    """The JSON document in the file at ``path``, bounded as ``loads``."""
    return loads(read_bounded(path, limit, where), where or str(path))
