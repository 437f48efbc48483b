"""The one reader of every JSON document gkbuild reads back: state and fingerprint records, fetch
records, store indexes, manifests, config/index/safetensors headers, golden metadata, the S3
mirror's record, compile-cache entries, signatures and provenance; and (``open_regular``) the one
way any input file is opened: recipes, safetensors files, goldens, tokenizer files.

Such a file is data from a disk or a store, possibly hostile: it is opened without blocking and
only read if it is a regular file (a FIFO would hold ``open()`` forever), its size is bounded before
it is read, its nesting before anything walks it (``[[[[...`` 200,000 deep would otherwise end in a
RecursionError traceback here or in whatever recurses over it later), and it is strict JSON (UTF-8
without a byte order mark, no NaN or Infinity, no number that overflows to one such as ``1e400``, no
key twice in an object).
Every failure is one ``BadJson`` line naming the file.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import GkError

MAX_DEPTH = 64  # the deepest document gkbuild writes is a manifest, about 8 levels


class BadJson(GkError, ValueError):
    """A JSON document that is too big, too deep, not strict JSON, or not JSON at all; or a file
    that is not a regular file."""


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text[:40]} overflows a double")
    return x


def _unique(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {json.dumps(twice)[:80]} appears twice in an object")
    return d


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
    if isinstance(data, (bytes, bytearray)):  # json.loads would guess UTF-16/32 and skip a BOM: strict is UTF-8
        if data.startswith(codecs.BOM_UTF8):
            raise BadJson(f"{where}: not UTF-8 JSON (starts with a byte order mark); refused")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadJson(f"{where}: not UTF-8 JSON (byte {e.start}); refused") from None
    try:
        obj = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite, object_pairs_hook=_unique)
    except RecursionError:
        raise BadJson(f"{where}: nested deeper than {MAX_DEPTH} levels; refused") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
        raise BadJson(f"{where}: not valid JSON ({str(e)[:100]})") from None
    why = depth_problem(obj)
    if why:
        raise BadJson(f"{where}: {why}; refused")
    return obj


_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def open_regular(path: Path, where: str | None = None, buffering: int = -1) -> BinaryIO:
    """The file at ``path`` opened for reading, only if it is a regular file. Opened with
    O_NONBLOCK (a FIFO's open() would wait for a writer forever) and judged by fstat of what was
    opened, not by the name. A folder raises IsADirectoryError as open() would (callers say what
    they expected there); anything else that is not a regular file is one BadJson line."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise BadJson(f"{where or path}: is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, "
                          f"not a regular file; refused unread")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path, limit: int, where: str | None = None) -> bytes:
    """At most ``limit`` bytes of the regular file at ``path`` (a bigger one is refused, not read whole)."""
    where = where or str(path)
    with open_regular(path, where) as f:
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
