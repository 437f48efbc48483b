"""Helpers that craft stores the way an attacker or a broken disk would (the build to publish is
the shared ``built`` / ``build`` of tests/conftest.py)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import zstandard

from gkbuild.pipeline import manifest as mf
from gkbuild.publish import index


def put_blob(store: Path, data: bytes, encoding: str = "zstd") -> dict:
    """Store ``data`` as a blob; its index entry fields (no path)."""
    sha = hashlib.sha256(data).hexdigest()
    stored = zstandard.ZstdCompressor().compress(data) if encoding == "zstd" else data
    name = index.blob_name(sha, encoding)
    (store / name).write_bytes(stored)
    return {"size": len(data), "sha256": sha, "encoding": encoding, "stored_size": len(stored), "blob": name}


def unzstd(stored: bytes) -> bytes:
    """A zstd blob's content: every frame of it (gkbuild writes a run of frames, ``codec.FRAME`` each)."""
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored), read_across_frames=True).read()


def read_store(store: Path) -> tuple[dict, dict]:
    idx = json.loads((store / index.NAME).read_text())
    e = idx["manifest"]
    raw = (store / e["blob"]).read_bytes()
    data = unzstd(raw) if e["encoding"] == "zstd" else raw
    return idx, json.loads(data)


def rewrite(store: Path, idx: dict, m: dict, fix_id: bool = True) -> None:
    """Write a (tampered) manifest and index into ``store``, the build id recomputed as a forger would."""
    if fix_id:
        m["build_id"] = mf.build_id(m)
    idx["manifest"] = put_blob(store, mf.canonical(m))
    idx["build_id"] = m["build_id"]
    (store / index.NAME).write_bytes(index.dumps(idx))
