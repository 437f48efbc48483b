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

STATE_DIR = ".gkbuild"


def key(*parts) -> str:
    """A cache key: sha256 of the canonical JSON of its parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """``data`` under ``path`` all at once: written beside it, fsynced, renamed, the folder synced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj, indent: int | None = 1) -> None:
    """Canonical JSON (sorted keys: byte-identical for identical content), written atomically."""
    write_bytes_atomic(path, (json.dumps(obj, indent=indent, sort_keys=True) + "\n").encode())


class State:
    def __init__(self, build_dir: Path):
        self.path = Path(build_dir) / STATE_DIR / "state.json"
        try:
            d = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            d = {}
        self.stages: dict[str, str] = d.get("stages", {})
        self.shards: dict[str, dict] = d.get("shards", {})
        self.source: dict = d.get("source", {})

    def save(self) -> None:
        write_json_atomic(self.path, {"stages": self.stages, "shards": self.shards, "source": self.source},
                          indent=None)
