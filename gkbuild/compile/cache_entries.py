"""A compile cache's entries (``compile/<key>.json`` in a store): their names, how one is made and
checked, and every entry a store holds. Apart from ``cache`` so that the stores (which keep the
blobs entries name when they prune) need not import the cache that uses them."""

from __future__ import annotations

import re

from ..errors import GkError
from ..publish import codec, index

FORMAT, VERSION = "gkbuild-compile-cache", 2
ENTRIES = "compile"
MAX_ENTRY = 1 << 20
MAX_ARTIFACT = 64 << 30  # a NEFF of the full model is a few GB
KEY = re.compile(r"^[0-9a-f]{64}$")


def entry_name(k: str) -> str:
    if not isinstance(k, str) or not KEY.match(k):
        raise GkError(f"compile cache: {str(k)[:80]!r} is not a compile key (64 hex digits)")
    return f"{ENTRIES}/{k}.json"


def make_entry(k: str, program: str, artifact: dict, encoding: str, stored_size: int, blob_sha: str) -> dict:
    """``artifact``: format, target, compiler, flags, size, sha256 (as in the manifest);
    ``blob_sha``: the sha256 of the blob's content (header and artifact)."""
    a = {f: artifact[f] for f in ("format", "target", "compiler", "flags", "size", "sha256")}
    a.update(encoding=encoding, stored_size=stored_size, blob_sha256=blob_sha, blob=index.blob_name(blob_sha, encoding))
    return {"format": FORMAT, "version": VERSION, "key": k, "program": program, "artifact": a}


def parse_entry(data: bytes, where: str, k: str | None = None) -> dict:
    """An entry, checked: format, version, key (the one asked for), sizes, hash and blob name."""
    e = index.load_versioned(data, where, FORMAT, VERSION, "compile-cache entry")
    a = e.get("artifact")
    ok = (isinstance(e.get("key"), str) and KEY.match(e["key"]) and isinstance(e.get("program"), str)
          and isinstance(a, dict) and all(isinstance(a.get(f), str) and KEY.match(a[f]) for f in ("sha256", "blob_sha256"))
          and a.get("encoding") in codec.EXT and isinstance(a.get("flags"), list) and isinstance(a.get("compiler"), dict)
          and all(isinstance(a.get(f), int) and 0 <= a[f] <= MAX_ARTIFACT for f in ("size", "stored_size")))
    if not ok:
        raise GkError(f"{where}: malformed compile-cache entry")
    if a.get("blob") != index.blob_name(a["blob_sha256"], a["encoding"]):
        raise GkError(f"{where}: names blob {a.get('blob')!r}, expected "
                      f"{index.blob_name(a['blob_sha256'], a['encoding'])}")
    if k is not None and e["key"] != k:
        raise GkError(f"{where}: is the entry of key {e['key'][:16]}, not {k[:16]}")
    return e


def entries(store) -> list[dict]:
    """Every entry in a cache store (malformed ones reported as such, not trusted)."""
    out = []
    for name in sorted(store.list(ENTRIES)):
        k = name[len(ENTRIES) + 1:].removesuffix(".json")
        try:
            raw = store.get(name, MAX_ENTRY)
            out.append(parse_entry(raw or b"", f"{store.uri}/{name}", k))
        except GkError as e:
            out.append({"key": k, "error": str(e)})
    return out
