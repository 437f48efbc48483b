"""What a build folder remembers about how it was made (``.gkbuild/state.json``).

Each stage records the key it ran with; each shard the key, size and sha256 it was written with.
A stage or shard whose key is unchanged (and whose outputs are still there) is not redone.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..checkpoint.safetensors_io import fsync_dir
from .. import jsonio
from ..errors import GkError, naming
from ..paths import STATE_DIR, confined, create, inside

MAX_RECORD = 64 << 20  # a state or fingerprint file is never near this; a bigger one is not read


def key(*parts) -> str:
    """A cache key: sha256 of the canonical JSON of its parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """``data`` under ``path`` all at once: written beside it, fsynced, renamed, the folder synced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with naming(path), os.fdopen(create(tmp), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def dumps_strict(obj, indent: int | None = 1) -> bytes:
    """Canonical JSON (sorted keys: byte-identical for identical content), strict: a NaN or an
    infinity is refused rather than written as a token strict JSON readers reject."""
    try:
        return (json.dumps(obj, indent=indent, sort_keys=True, allow_nan=False) + "\n").encode()
    except ValueError as e:
        raise GkError(f"internal: refusing to write non-finite JSON ({e})") from None


def write_json_atomic(path: Path, obj, indent: int | None = 1) -> None:
    write_bytes_atomic(path, dumps_strict(obj, indent))


def read_json_record(path: Path, valid) -> dict | None:
    """A record gkbuild keeps for itself (state, fingerprints, fetch progress): None when absent.
    One that is unreadable, too big, not JSON, or that ``valid(obj)`` rejects (it returns why, or
    None) is set aside as ``<name>.corrupt-<n>`` with a warning: it never blocks a build."""
    from ..progress import warn

    try:
        obj = jsonio.read(path, MAX_RECORD)
        why = valid(obj)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except jsonio.BadJson as e:
        why = str(e).removeprefix(f"{path}: ")
    except OSError as e:
        why = str(e) or type(e).__name__
    if why is None:
        return obj
    n = 0
    while os.path.lexists(aside := path.with_name(f"{path.name}.corrupt-{n}")):
        n += 1
    try:
        os.replace(path, aside)
    except OSError as e:  # a read-only cache: ignored, not moved
        warn(f"{path}: unreadable ({why[:120]}); ignored (cannot set it aside: {e.strerror})")
        return None
    warn(f"{path}: unreadable ({why[:120]}); set aside as {aside.name} and starting afresh")
    return None


def stat_of(path: Path) -> list[int]:
    """What says a file was not written since: size, mtime, ctime (no one but the kernel sets
    it: an edit that puts the mtime back still moves it) and inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def intact(path: Path, rec: dict) -> bool:
    """Whether the file a state record describes (``size``, ``sha256``, ``stat``) still holds what
    was written: unchanged since (its stat), or else its bytes hash to the record. A reused stage's
    outputs pass this before a manifest vouches for them."""
    from .fingerprint import sha256_file

    try:
        st = stat_of(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if st[0] != rec["size"] or not os.path.isfile(path):
        return False
    return rec.get("stat") == st or sha256_file(path) == rec["sha256"]


def _state_problem(d) -> str | None:
    if not isinstance(d, dict):
        return "not a JSON object"
    stages, shards, source = d.get("stages", {}), d.get("shards", {}), d.get("source", {})
    for what, m in (("stages", stages), ("artifacts", d.get("artifacts", {}))):
        if not (isinstance(m, dict) and all(isinstance(v, str) for v in m.values())):
            return f"{what} is not a map of keys"
    if not isinstance(source, dict) or not isinstance(shards, dict):
        return "source or shards is not an object"
    for path, rec in shards.items():
        try:
            confined(path, "shards")
        except GkError as e:
            return str(e)
        if not (isinstance(rec, dict) and isinstance(rec.get("key"), str) and isinstance(rec.get("sha256"), str)
                and isinstance(rec.get("size"), int) and not isinstance(rec["size"], bool)):
            return f"shard record for {path} is malformed"
    return None


class State:
    def __init__(self, build_dir: Path):
        self.path = inside(Path(build_dir), f"{STATE_DIR}/state.json")
        d = read_json_record(self.path, _state_problem) or {}
        self.stages: dict[str, str] = d.get("stages", {})
        self.shards: dict[str, dict] = d.get("shards", {})
        self.source: dict = d.get("source", {})
        self.artifacts: dict[str, str] = d.get("artifacts", {})  # compiled path -> sha256 as written
        self._saved = self._bytes() if d else None

    def _bytes(self) -> bytes:
        return dumps_strict({"stages": self.stages, "shards": self.shards, "source": self.source,
                             "artifacts": self.artifacts}, indent=None)

    def save(self) -> None:
        """Write the state (atomically, synced) unless it is what the file already holds: a no-op
        build writes nothing."""
        data = self._bytes()
        if data != self._saved:
            write_bytes_atomic(self.path, data)
            self._saved = data
