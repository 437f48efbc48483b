"""Paths taken from data (state files, indexes, manifests) and folders gkbuild writes into.

A path read from a file is hostile until proved otherwise: ``confined`` accepts only a plain
relative path that stays inside its folder. ``owned`` decides whether gkbuild may write into a
folder at all: an empty one, or one its state folder marks as a gkbuild build.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path

from .errors import GkError, shown

STATE_DIR = ".gkbuild"
# Beside a build's manifest: its signature and signed provenance (gkbuild.publish.signing).
SIGNATURE, PROVENANCE = "manifest.sig", "provenance.json"
RESERVED = (STATE_DIR, "manifest.json", SIGNATURE, PROVENANCE)
MAX_PATH = 4096


def confined(path: object, where: str) -> str:
    """A build-relative path that stays inside the folder it names a file of: relative, no
    ``..``, no empty or dot components, no backslashes, not the state folder or the manifest."""
    parts = path.split("/") if isinstance(path, str) and len(path) <= MAX_PATH else []
    if (not parts or path.startswith("/") or "\\" in path or "\0" in path
            or any(p in ("", ".", "..") for p in parts) or parts[0] in RESERVED):
        raise GkError(f"{where}: path {shown(path)} would escape the build folder (or is reserved); refused")
    return path


def resolved(path: os.PathLike | str, what: str) -> Path:
    """``path`` absolute, its links followed; a symlink loop on the way (``Path.resolve`` raises
    RuntimeError on one before Python 3.13) or a link that cannot be followed is one line naming
    ``what`` (the option or key it came from)."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):
        raise GkError(f"{what} {path}: a symlink loop (a link that leads back to itself); give a real "
                      f"path") from None


def inside(root: Path, rel: str) -> Path:
    """``root/rel`` for a confined ``rel``, refusing if a folder on the way is a symlink or not a
    folder, or the file itself is a symlink (nothing is written or deleted through a link).

    Every write and delete gkbuild makes inside a build, a store or a cache goes through this
    (and ``create`` for the file itself): a link planted anywhere below ``root`` is refused."""
    p = root
    for part in rel.split("/")[:-1]:
        p = p / part
        if os.path.islink(p) or (p.exists() and not p.is_dir()):
            raise GkError(f"{p}: is a symlink or not a folder; refusing to use {rel} through it")
    target = root / rel
    if os.path.islink(target):
        raise GkError(f"{target}: is a symlink; refused")
    return target


def create(path: Path, mode: int = 0o644) -> int:
    """A file descriptor of ``path`` opened for writing, created or truncated, never through a
    symlink at ``path`` itself (a planted or dangling link is refused, not followed)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)


# Temporaries gkbuild itself writes beside a final name; only these are ever cleaned up.
# (``.decode.pt2.<pid>.cache.partial``: a program being restored from the compile cache.)
TEMP = re.compile(r"^(\..+\.\d+\.(cache\.)?partial(\.pt2)?|.+\.safetensors\.\d+\.\d+\.partial|\.tmp-[a-z]+-\d+)$")


def our_temporaries(root: Path) -> list[Path]:
    """Leftover temporaries of an interrupted gkbuild run under ``root`` (state folder excluded),
    recognised by the exact names gkbuild gives them."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        if Path(dirpath) == root and STATE_DIR in dirs:
            dirs.remove(STATE_DIR)
        out += [Path(dirpath) / n for n in files + dirs if TEMP.match(n)]
    return sorted(out)


def marked(folder: Path) -> bool:
    """Whether ``folder`` is a gkbuild build (its state folder says so)."""
    state = folder / STATE_DIR
    return any(os.path.isfile(p) and not os.path.islink(p) for p in (state / "build", state / "state.json")) \
        and not os.path.islink(state)


def claim(folder: Path) -> None:
    """Make ``folder`` a gkbuild build folder, or refuse: it must be empty or already one.
    Never a file, never the root, never a folder holding someone else's files."""
    folder = Path(folder)
    if os.path.lexists(folder) and not folder.is_dir():
        raise GkError(f"{folder}: exists and is not a folder; give a new, empty or build folder as the output")
    real = resolved(folder, "output folder")
    if real == Path(real.anchor):
        raise GkError(f"{folder}: refusing to build into the file system root")
    if folder.exists() and not marked(folder):
        first = next((e.name for e in sorted(os.scandir(folder), key=lambda e: e.name)), None)
        if first is not None:
            raise GkError(f"{folder}: not empty and not a gkbuild build (holds {first!r}); build into a new "
                          f"or empty folder, or remove it")
    marker = inside(folder, f"{STATE_DIR}/build")
    marker.parent.mkdir(parents=True, exist_ok=True)
    for sub in ("weights", "compiled", "layout"):  # what a build writes into: never through a link
        inside(folder, f"{sub}/x")
    with os.fdopen(create(marker), "w") as f:
        f.write("a gkbuild build folder: gkbuild compile may rewrite it\n")


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True):
    """An exclusive advisory lock held on ``path`` (a file, created if needed, or a folder: locked
    as it is, nothing written into it) for the block's duration; with ``wait`` False, None is
    yielded at once if another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(path) and not os.path.islink(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)
