"""File content hashes, computed once and remembered.

A file's sha256 is remembered in ``$GKBUILD_CACHE/fingerprints.json`` under its real path, size
and mtime; a hub cache file that links to ``blobs/<sha256>`` (git LFS) needs no hashing at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ..checkpoint.safetensors_io import fsync_dir

_SHA = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 8 << 20


def sha256_file(path: Path, advance=lambda n: None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            advance(n)
    return h.hexdigest()


def identity(path: Path) -> str:
    """What a remembered hash is keyed by: real path, size, mtime."""
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"


def lfs_sha(path: Path) -> str | None:
    """The sha256 a hub cache gives for free: an LFS snapshot file links to blobs/<sha256>."""
    if os.path.islink(path):
        name = Path(os.path.realpath(path)).name
        if _SHA.match(name) and Path(os.path.realpath(path)).parent.name == "blobs":
            return name
    return None


class Fingerprints:
    def __init__(self, cache_dir: Path):
        self.path = Path(cache_dir) / "fingerprints.json"
        try:
            self.known: dict[str, str] = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            self.known = {}

    def lookup(self, path: Path) -> str | None:
        return lfs_sha(path) or self.known.get(identity(path))

    def remember(self, path: Path, digest: str) -> None:
        self.known[identity(path)] = digest

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.known, indent=0, sort_keys=True))
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
