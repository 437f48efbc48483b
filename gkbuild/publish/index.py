"""The publish index (``publish.json``): where each file of a published build is stored, and how.

A store holds ``publish.json`` and ``blobs/<sha256>.<zst|raw>``, one blob per distinct file
content (named by the sha256 of the *uncompressed* bytes, so whether a file is already stored is
known without compressing it). The index names the build, its manifest blob, and for every file
its size, sha256, encoding and stored size. Writing the index is the commit: blobs nobody
references are invisible, so a reader never sees half a build.

The manifest stays the authority on content: a fetch checks the index against it (same paths,
sizes and hashes) and every byte against the hash.
"""

from __future__ import annotations

import json
import re

from .. import jsonio
from ..errors import GkError
from ..paths import confined
from .codec import EXT

NAME = "publish.json"
FORMAT = "gkbuild-publish"
VERSION = 1
_SHA = re.compile(r"^[0-9a-f]{64}$")
_BLOB = re.compile(r"^blobs/[0-9a-f]{64}\.(zst|raw)$")


def blob_name(sha256: str, encoding: str) -> str:
    return f"blobs/{sha256}.{EXT[encoding]}"


def is_blob(name: str) -> bool:
    """A name a publish could have written under ``blobs/`` (what a store may list or delete)."""
    return bool(_BLOB.match(name))


def entry(path: str, size: int, sha256: str, encoding: str, stored_size: int) -> dict:
    return {"path": path, "size": size, "sha256": sha256, "encoding": encoding, "stored_size": stored_size,
            "blob": blob_name(sha256, encoding)}


SIGNED = ("signature", "provenance")  # beside the manifest when the build is signed


def make(manifest: dict, manifest_entry: dict, files: list[dict], signed: dict | None = None) -> dict:
    """``signed``: the signature's and provenance's entries (no path), for a signed build."""
    return {"format": FORMAT, "version": VERSION, "name": manifest["name"], "build_id": manifest["build_id"],
            "manifest": manifest_entry, "files": sorted(files, key=lambda e: e["path"]), **(signed or {})}


def blobs(index: dict) -> set[str]:
    """Every blob an index references (the manifest's, signature's and provenance's included)."""
    return {e["blob"] for e in [index["manifest"], *index["files"], *(index[k] for k in SIGNED if k in index)]}


def by_kind(entries: list[dict]) -> dict[str, dict]:
    """Entries summed per file kind (``weights/expert-017.safetensors`` -> ``weights/expert``):
    files, bytes, stored bytes, and how many are zstd."""
    out: dict[str, dict] = {}
    for e in entries:
        folder, _, name = e["path"].rpartition("/")
        k = out.setdefault(f"{folder}/{name.split('-')[0].split('.')[0]}",
                           {"files": 0, "bytes": 0, "stored": 0, "zstd": 0})
        k["files"] += 1
        k["bytes"] += e["size"]
        k["stored"] += e["stored_size"]
        k["zstd"] += e["encoding"] == "zstd"
    return dict(sorted(out.items()))


def dumps(index: dict) -> bytes:
    return (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()


def load_versioned(data: bytes, where: str, fmt: str, version: int, what: str) -> dict:
    """A JSON object of a gkbuild ``format`` and ``version`` (what a store holds), else one line."""
    doc = jsonio.loads(data, where)
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise GkError(f"{where}: not a gkbuild {what}")
    if doc.get("version") != version:
        raise GkError(f"{where}: {what} version {doc.get('version')!r} is not supported "
                      f"(this gkbuild reads version {version}); use a matching gkbuild")
    return doc


def parse(data: bytes, where: str) -> dict:
    """Read and check an index: the format and version, and every entry's shape and blob name."""
    idx = load_versioned(data, where, FORMAT, VERSION, "publish index")
    files = idx.get("files")
    if not isinstance(files, list) or not isinstance(idx.get("manifest"), dict):
        raise GkError(f"{where}: malformed index (no files or manifest entry)")
    seen = set()
    signed = [idx[k] for k in SIGNED if k in idx]
    if len(signed) not in (0, 2):
        raise GkError(f"{where}: malformed index (a signature without its provenance, or the reverse)")
    for e in [*signed, idx["manifest"], *files]:
        _check_entry(e, where)
        if e is not idx["manifest"] and e not in signed:
            confined(e["path"], where)
            if e["path"] in seen:
                raise GkError(f"{where}: {e['path']} is listed twice")
            seen.add(e["path"])
    return idx


def _check_entry(e: object, where: str) -> None:
    ok = (isinstance(e, dict) and isinstance(e.get("sha256"), str) and _SHA.match(e["sha256"])
          and e.get("encoding") in EXT and all(isinstance(e.get(k), int) and e[k] >= 0 for k in ("size", "stored_size")))
    if not ok:
        raise GkError(f"{where}: malformed entry {json.dumps(e)[:120]}")
    if e.get("blob") != blob_name(e["sha256"], e["encoding"]):
        raise GkError(f"{where}: entry for {e.get('path', 'the manifest')} names blob {e.get('blob')!r}, "
                      f"expected {blob_name(e['sha256'], e['encoding'])}")
