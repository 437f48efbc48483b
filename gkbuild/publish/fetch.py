"""``gkbuild fetch``: a published build into a folder a runtime can trust.

Nothing reaches its final name until its bytes hash to what the manifest says; the manifest is
written last, so a folder with ``manifest.json`` is a complete, verified build. Refused, with
nothing unverified left behind: a hash or size that differs, a path that would leave the folder
(``..``, absolute, through a symlink), a file the manifest does not list (or one it lists that the
store lacks), data that decodes past its declared size, an index or manifest of an unknown
version, a manifest edited after its build. Verified files are recorded as they land
(``.gkbuild/fetch.json``), so an interrupted fetch resumes without downloading them again.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from pathlib import Path

from ..pipeline import manifest as mf
from ..pipeline.fingerprint import sha256_file
from ..pipeline.state import STATE_DIR, read_json_record, write_bytes_atomic, write_json_atomic
from ..checkpoint.safetensors_io import fsync_dir
from ..errors import GkError, naming
from ..paths import PROVENANCE, SIGNATURE, confined, create, inside
from ..progress import bar
from . import codec, index, signing
from .parallel import run_each
from .stores import open_store

RECORD = f"{STATE_DIR}/fetch.json"


def read_manifest(store) -> tuple[dict, dict, bytes]:
    """(index, manifest, manifest bytes) of a store, each checked: versions, the manifest's hash
    against the index, the build id against the content, and the index against the manifest."""
    raw = store.read_index()
    if raw is None:
        raise GkError(f"{store.uri}: no {index.NAME} (not a gkbuild store, or nothing published there yet)")
    idx = index.parse(raw, f"{store.uri}/{index.NAME}")
    e = idx["manifest"]
    where = f"{store.uri}/{e['blob']} (the manifest)"
    if e["size"] > mf.MAX_MANIFEST:
        raise GkError(f"{where}: declares {e['size']} bytes; a manifest is never that large")
    buf = io.BytesIO()
    with store.open_blob(e["blob"]) as f:
        got = codec.decode(f, buf, e["encoding"], e["size"], e["stored_size"], where)
    if got != e["sha256"]:
        raise GkError(f"{where}: sha256 {got[:16]} differs from the index's {e['sha256'][:16]}")
    m = mf.parse(buf.getvalue(), where)
    if m["build_id"] != idx["build_id"]:
        raise GkError(f"{store.uri}: the index is for build {idx['build_id'][:16]}, its manifest is "
                      f"build {m['build_id'][:16]}")
    listed = {f["path"]: f for f in m["files"]}
    for f in idx["files"]:
        g = listed.get(f["path"])
        if g is None:
            raise GkError(f"{store.uri}: {f['path']} is not listed in the manifest; refused")
        if (g["size"], g["sha256"]) != (f["size"], f["sha256"]):
            raise GkError(f"{store.uri}: the index and the manifest disagree on {f['path']}")
    missing = sorted(listed.keys() - {f["path"] for f in idx["files"]})
    if missing:
        raise GkError(f"{store.uri}: the store lacks {missing[0]} (and {len(missing) - 1} more) the manifest lists")
    for p in listed:
        confined(p, f"{store.uri} manifest")
    return idx, m, buf.getvalue()


def read_signed(store, idx: dict) -> tuple[bytes, bytes] | None:
    """(signature, provenance) a store keeps beside a build's manifest, or None when unsigned;
    each bounded and checked against its index entry."""
    if "signature" not in idx:
        return None
    out = []
    for k, limit in (("signature", signing.MAX_SIGNATURE), ("provenance", signing.MAX_PROVENANCE)):
        e, buf = idx[k], io.BytesIO()
        where = f"{store.uri}/{e['blob']} (the {k})"
        if e["size"] > limit:
            raise GkError(f"{where}: declares {e['size']} bytes; a {k} is never that large")
        with store.open_blob(e["blob"]) as f:
            if codec.decode(f, buf, e["encoding"], e["size"], e["stored_size"], where) != e["sha256"]:
                raise GkError(f"{where}: its content is not the sha256 the index names")
        out.append(buf.getvalue())
    return out[0], out[1]


def check_trust(store, idx: dict, m: dict, man_bytes: bytes, trust: list | None):
    """(signature and provenance, or None; who signed, or None without ``trust``): with ``trust``,
    the build is refused unless one of it signed exactly this manifest (before any file is read)."""
    signed = read_signed(store, idx)
    if trust is None:
        return signed, None
    return signed, signing.verify(man_bytes, signed, trust, f"{store.uri} (build {m['name']} {m['build_id'][:16]})")


def _record_problem(d) -> str | None:
    if not isinstance(d, dict) or not isinstance(d.get("files"), dict):
        return "not a fetch record"
    for rel, r in d["files"].items():
        try:
            confined(rel, "fetch record")
        except GkError as e:
            return str(e)
        if not (isinstance(r, list) and len(r) == 3 and isinstance(r[2], str)):
            return f"malformed entry for {rel}"
    return None


class _Record:
    """Files verified into ``dest`` so far: path -> [size, mtime_ns, sha256], for one build."""

    def __init__(self, dest: Path, build_id: str):
        self.path = dest / RECORD
        self.build_id = build_id
        self.lock = threading.Lock()
        data = read_json_record(self.path, _record_problem) or {}
        self.files = data.get("files", {})
        self.previous_build = data.get("build_id")

    def intact(self, dest: Path, rel: str, sha256: str) -> bool:
        r = self.files.get(rel)
        if not r or r[2] != sha256:
            return False
        try:
            st = os.lstat(dest / rel)
        except FileNotFoundError:
            return False
        return [st.st_size, st.st_mtime_ns] == r[:2]

    def add(self, dest: Path, rel: str, sha256: str) -> None:
        st = os.stat(dest / rel)
        with self.lock:
            self.files[rel] = [st.st_size, st.st_mtime_ns, sha256]
            write_json_atomic(self.path, {"build_id": self.build_id, "files": self.files})


def _own_leftovers(dest: Path) -> list[Path]:
    """What a fetch killed mid-write leaves: the temporary of its record, or of the manifest, the
    signature or the provenance it writes last (``write_bytes_atomic``'s ``.NAME.<pid>.partial``).
    Only regular files of exactly those names: nothing else is ever removed."""
    found = []
    for folder, names in ((dest / STATE_DIR, [Path(RECORD).name]), (dest, [mf.NAME, SIGNATURE, PROVENANCE])):
        for name in names:
            found += [p for p in folder.glob(f".{name}.*.partial") if re.fullmatch(r"[0-9]+", p.name[len(name) + 2:-8])
                      and p.is_file() and not p.is_symlink()] if folder.is_dir() else []
    return found


def _prepare(dest: Path, m: dict, record: _Record) -> None:
    """Refuse a folder that holds another build or files this fetch cannot vouch for; drop files an
    earlier, interrupted fetch of another build verified that this build does not have. A file in
    place that the record does not list (a kill between moving it in and recording it) is hashed:
    kept and recorded if it is the manifest's content, else refused by name."""
    if (dest / mf.NAME).exists():
        raise GkError(f"{dest}: already holds a build ({mf.NAME} present); fetch into a new or empty folder")
    wanted = {f["path"]: f["sha256"] for f in m["files"]}
    for rel in list(record.files):
        if wanted.get(rel) != record.files[rel][2]:
            inside(dest, rel).unlink(missing_ok=True)
            del record.files[rel]
    for p in sorted(dest.rglob("*")) if dest.exists() else []:
        rel = p.relative_to(dest).as_posix()
        if rel in (SIGNATURE, PROVENANCE) or rel.split("/")[0] == STATE_DIR or (p.is_dir() and not p.is_symlink()):
            continue
        if rel in record.files:
            continue
        if rel in wanted and p.is_file() and not p.is_symlink() and sha256_file(p) == wanted[rel]:
            record.add(dest, rel, wanted[rel])
            continue
        raise GkError(f"{dest}: holds {rel}, which no fetch verified (its content is not the manifest's); "
                      f"fetch into a new or empty folder")


def fetch(src: str, dest: Path, expect: str | None = None, jobs: int | None = None, quiet: bool = False,
          api=None, fs=None, trust: list | None = None) -> dict:
    """Fetch the build published at ``src`` into ``dest``; returns a report. ``trust``: keys and
    identities (``signing.trust_list``), one of which must have signed the build: checked before
    anything is written, and the signature kept beside the manifest for ``Build.open(trust=...)``."""
    dest = Path(dest)
    store = open_store(src, api=api, fs=fs)
    idx, m, man_bytes = read_manifest(store)
    signed, v = check_trust(store, idx, m, man_bytes, trust)
    if expect and not (len(expect) >= 12 and m["build_id"].startswith(expect.lower())):
        raise GkError(f"{store.uri}: holds build {m['build_id'][:16]}, not the expected {expect} "
                      f"(give at least 12 hex digits)")
    if os.path.lexists(dest) and not dest.is_dir():
        raise GkError(f"{dest}: exists and is not a folder; fetch into a new or empty folder")
    report = {"store": store.uri, "build_id": m["build_id"], "name": m["name"], "dest": str(dest),
              "files": len(m["files"]), "fetched_files": 0, "fetched_bytes": 0, "stored_bytes": 0,
              "signed_by": str(v.by) if v is not None else None}
    if (dest / mf.NAME).exists() and mf.read_bytes(dest) == man_bytes:
        report["already"] = True
        return report
    inside(dest, f"{STATE_DIR}/fetch/x")  # the staging folder is not reached through a symlink either
    for p in _own_leftovers(dest):
        p.unlink()
    record = _Record(dest, m["build_id"])
    _prepare(dest, m, record)
    staging = dest / STATE_DIR / "fetch"
    staging.mkdir(parents=True, exist_ok=True)
    for p in staging.iterdir():  # an interrupted fetch's temporaries (only ours live here)
        if p.name.endswith(".partial") and p.is_file() and not p.is_symlink():
            p.unlink()
    todo = [f for f in idx["files"] if not record.intact(dest, f["path"], f["sha256"])]

    def fetch_one(f: dict) -> None:
        target = inside(dest, f["path"])
        tmp = dest / STATE_DIR / "fetch" / f".{f['sha256'][:32]}.{threading.get_ident()}.partial"
        where = f"{store.uri}/{f['blob']} ({f['path']})"
        try:
            with naming(target), store.open_blob(f["blob"]) as s, os.fdopen(create(tmp), "wb") as out:
                got = codec.decode(s, out, f["encoding"], f["size"], f["stored_size"], where, advance)
                out.flush()
                os.fsync(out.fileno())
            if got != f["sha256"]:
                raise GkError(f"{where}: sha256 {got[:16]} differs from the manifest's {f['sha256'][:16]}; refused")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, target)
            fsync_dir(target.parent)
        finally:
            tmp.unlink(missing_ok=True)
        record.add(dest, f["path"], f["sha256"])
        with record.lock:
            report["fetched_files"] += 1
            report["fetched_bytes"] += f["size"]
            report["stored_bytes"] += f["stored_size"]

    with bar(f"fetch {m['name']}", sum(f["size"] for f in todo), quiet) as advance:
        run_each(fetch_one, todo, jobs or store.concurrency)
    signing.write_folder(dest, signed)
    write_bytes_atomic(dest / mf.NAME, man_bytes)
    (dest / RECORD).unlink(missing_ok=True)
    staging.rmdir()
    with contextlib.suppress(OSError):
        (dest / STATE_DIR).rmdir()  # empty unless something else keeps state there
    report["already"] = False
    report["reused_files"] = len(m["files"]) - report["fetched_files"]
    return report
