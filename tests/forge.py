"""A build folder edited as a forger would: files rewritten, and the manifest made consistent with
them (each file's size and sha256, then the build id), so that only gkbuild's own checks of what
the files say stand in the way (there is no signature to break)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from gkbuild.pipeline import manifest as mf


def forge(build: Path, files: dict[str, bytes | dict] = {}, edit: Callable[[dict], None] = lambda m: None) -> None:  # noqa: B006
    """Write ``files`` (path in the build -> bytes, or a dict written as JSON), list them in the
    manifest as they now are, apply ``edit`` to the manifest and give it a matching build id."""
    m = json.loads((build / mf.NAME).read_bytes())
    for rel, data in files.items():
        data = json.dumps(data).encode() if isinstance(data, dict) else data
        (build / rel).write_bytes(data)
        entry = next(f for f in m["files"] if f["path"] == rel)
        entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    edit(m)
    m["build_id"] = mf.build_id(m)
    (build / mf.NAME).write_bytes(json.dumps(m, indent=1, sort_keys=True).encode())


def kv_doc(build: Path) -> dict:
    return json.loads((build / "layout" / "kv.json").read_bytes())
