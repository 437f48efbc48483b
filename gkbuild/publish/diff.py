"""``gkbuild diff``: what changed between two builds, as a reviewer needs it before promoting one.

Either side is a build folder or a store (a published folder or ``hf://``); only manifests are
read. Reported: recipe keys, source (URI, revision, weight files), tool and compiler versions,
files added, removed or changed, and the ranks whose loaded files changed.
"""

from __future__ import annotations

from pathlib import Path

from ..pipeline import manifest as mf
from ..errors import GkError
from ..plan import rank_ranges
from .fetch import read_manifest
from .stores import open_store


def load(ref: str, api=None, fs=None) -> dict:
    """The manifest of a build folder, or of the build a store holds."""
    p = Path(ref)
    if "://" not in ref:
        if (p / mf.NAME).exists():
            return mf.load(p)
        if not p.exists():
            raise GkError(f"{ref}: no such build folder or store")
    return read_manifest(open_store(ref, api=api, fs=fs))[1]


def _flat(d, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _changes(a: dict, b: dict) -> list[dict]:
    fa, fb = _flat(a), _flat(b)
    return [{"key": k, "a": fa.get(k), "b": fb.get(k)} for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]


def _compilers(m: dict) -> dict:
    return {a["name"]: {"format": a["format"], "compiler": a["compiler"], "flags": a["flags"], "status": a["status"],
                        "sha256": a.get("sha256")}
            for a in m["compile"]["artifacts"]} | {"status": m["compile"]["status"]}


def diff(a: dict, b: dict) -> dict:
    """A structured difference of two manifests (empty lists/dicts where they agree)."""
    src = lambda m: {k: v for k, v in m["source"].items() if k != "files"}  # noqa: E731
    src_files = lambda m: {f["name"]: f["sha256"] for f in m["source"].get("files", [])}  # noqa: E731
    files_a = {f["path"]: f for f in a["files"]}
    files_b = {f["path"]: f for f in b["files"]}
    changed = sorted(p for p in files_a.keys() & files_b.keys() if files_a[p]["sha256"] != files_b[p]["sha256"])
    added, removed = sorted(files_b.keys() - files_a.keys()), sorted(files_a.keys() - files_b.keys())
    moved = set(changed) | set(added) | set(removed)
    loads = lambda m: {r["rank"]: sorted(x["file"] for x in r["loads"]) for r in m["ranks"]}  # noqa: E731
    la, lb = loads(a), loads(b)
    ranks = sorted(r for r in la.keys() | lb.keys()
                   if la.get(r) != lb.get(r) or any(f in moved for f in la.get(r, []) + lb.get(r, [])))
    return {
        "a": {"name": a["name"], "build_id": a["build_id"]},
        "b": {"name": b["name"], "build_id": b["build_id"]},
        "identical": a["build_id"] == b["build_id"],
        "recipe": _changes(a["recipe"]["resolved"], b["recipe"]["resolved"]),
        "source": _changes(src(a), src(b)),
        "source_files": _changes(src_files(a), src_files(b)),
        "tools": _changes(a["tools"], b["tools"]),
        "compile": _changes(_compilers(a), _compilers(b)),
        "files": {"changed": [{"path": p, "a": files_a[p]["size"], "b": files_b[p]["size"]} for p in changed],
                  "added": added, "removed": removed},
        "ranks": {"changed": len(ranks), "of": len(lb), "which": rank_ranges(ranks)},
    }
