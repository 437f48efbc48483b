"""File content hashes, computed once and remembered.

A file's sha256 is remembered in ``$GKBUILD_CACHE/fingerprints.json`` under its real path, size,
mtime and inode; a hub cache file that links to ``blobs/<sha256>`` (git LFS) needs no hashing at all.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..jsonio import open_regular
from ..paths import file_lock
from .state import read_json_record, write_json_atomic

_SHA = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 8 << 20


def sha256_file(path: Path, advance=lambda n: None) -> str:
    h = hashlib.sha256()
    with open_regular(path, buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            advance(n)
    return h.hexdigest()


def identity(path: Path) -> str:
    """What a remembered hash is keyed by: real path, size, mtime, inode and ctime (a file
    replaced by another, even of the same size and time, is hashed again; so is one edited in
    place with its mtime put back: no one but the kernel sets the ctime)."""
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"


def lfs_sha(path: Path) -> str | None:
    """The sha256 a hub cache gives for free: an LFS snapshot file links to blobs/<sha256>."""
    if os.path.islink(path):
        name = Path(os.path.realpath(path)).name
        if _SHA.match(name) and Path(os.path.realpath(path)).parent.name == "blobs":
            return name
    return None


def _key(path: Path, scope: str | None) -> str:
    return identity(path) if scope is None else f"{scope}|{identity(path)}"


class Fingerprints:
    """Remembered hashes. Several builds may share one cache: the record is read and merged under
    a file lock, so no process's hashes overwrite another's, and a corrupt record is set aside."""

    def __init__(self, cache_dir: Path):
        self.path = Path(cache_dir) / "fingerprints.json"
        self.known: dict[str, str] = self._read()
        self._new: dict[str, str] = {}

    def _read(self) -> dict[str, str]:
        def problem(d):
            ok = isinstance(d, dict) and all(isinstance(v, str) and _SHA.match(v) for v in d.values())
            return None if ok else "not a map of sha256 digests"

        return read_json_record(self.path, problem) or {}

    def lookup(self, path: Path, scope: str | None = None) -> str | None:
        """The remembered sha256 of ``path``; with ``scope`` (a runtime: the sha256 of the manifest
        that vouches for the file), only a hash remembered under that same scope."""
        return (lfs_sha(path) if scope is None else None) or self.known.get(_key(path, scope))

    def remember(self, path: Path, digest: str, scope: str | None = None) -> None:
        self.known[_key(path, scope)] = self._new[_key(path, scope)] = digest

    def lookup_remote(self, ident: str) -> str | None:
        """The remembered sha256 of a remote file, by ``ident`` (its location, size and ETag or
        commit: what pins its content)."""
        return self.known.get(f"remote|{ident}")

    def remember_remote(self, ident: str, digest: str) -> None:
        self.known[f"remote|{ident}"] = self._new[f"remote|{ident}"] = digest

    def save(self) -> None:
        if not self._new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(self.path.with_name("fingerprints.lock")):
            self.known = {**self._read(), **self._new}
            write_json_atomic(self.path, self.known, indent=0)
        self._new = {}
