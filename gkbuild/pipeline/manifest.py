"""manifest.json: the contract with runtimes.

Versioned (``schema_version``, JSON Schema shipped in ``gkbuild/schemas``); lists every file with
its size and sha256, the source and its file hashes, the recipe, model, topology and meshes, tool
versions, layout metadata, for every rank its coordinates, the files and tensors its device loads and
its device memory, and apart from those the host-side files with the program that uses them.
Reproducible: no timestamps or machine paths; ``build_id`` is the sha256 of everything else.
"""

from __future__ import annotations

import hashlib
import json
import platform
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from .. import __version__
from ..errors import GkError

SCHEMA_VERSION = 2
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "schemas" / f"manifest-v{SCHEMA_VERSION}.json"
NAME = "manifest.json"
MAX_MANIFEST = 64 << 20  # the 120b manifest is a few MB; a bigger one is refused unread


def tool_versions() -> dict:
    def v(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"gkbuild": __version__, "python": platform.python_version(), "torch": v("torch"),
            "numpy": v("numpy"), "safetensors": v("safetensors")}


def canonical(obj) -> bytes:
    """The manifest's bytes: sorted keys, strict JSON (a NaN or an infinity is refused)."""
    from .state import dumps_strict

    return dumps_strict(obj, indent=1)


def build_id(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "build_id"}
    return hashlib.sha256(canonical(body)).hexdigest()


@lru_cache(maxsize=None)
def schema(version: int = SCHEMA_VERSION) -> dict:
    return json.loads((SCHEMA_FILE.parent / f"manifest-v{version}.json").read_text())


@lru_cache(maxsize=None)
def _validator():
    from jsonschema.validators import validator_for

    return validator_for(schema())(schema())


def validate(manifest: dict, where: str = NAME) -> None:
    """Against the schema, stopping at the first error (``jsonschema.validate`` would check the
    schema itself and then collect every error to pick the best: seconds for a 128-rank manifest)."""
    e = next(_validator().iter_errors(manifest), None)
    if e is not None:
        at = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GkError(f"{where}: does not match schema v{SCHEMA_VERSION} at {at}: {e.message}")


def make(plan, source_info: dict, files: list[dict], stages: list[dict], compile_entry: dict) -> dict:
    """Assemble the manifest, its build_id last (checked against the schema when written)."""
    r = plan.recipe
    t = r.topology
    by_path = {f["path"]: f for f in files}
    ranks = []
    for c in plan.ranks:
        loads = [{"file": f.path, "tensors": [s.name for s in f.tensors]} for f in plan.files_of(c.rank)]
        mem = plan.device_memory(c.rank)
        ranks.append({**c.to_dict(), "loads": loads,
                      "device": mem})
    m = {
        "schema_version": SCHEMA_VERSION,
        "name": r.name,
        "target": r.target,
        "recipe": {"digest": r.digest(), "resolved": {k: v for k, v in r.to_dict().items() if k != "output"}},
        "source": source_info,
        "model": plan.config.to_hf(),
        "topology": {"tp": t.tp, "dp": t.dp, "ep": t.ep, "lnc": t.lnc, "vtp": t.vtp, "hops": r.hops,
                     "a2a_batch_groups": t.a2a_batch_groups, "world_size": plan.world,
                     "meshes": {"tp_replica_group": plan.meshes["tp_replica_group"],
                                "ep_replica_group": plan.meshes["ep_replica_group"],
                                "tail_hop_meshes": plan.tail["hop_meshes"]}},
        "tools": tool_versions(),
        "files": sorted(files, key=lambda f: f["path"]),
        "layout": {"kv": {"file": "layout/kv.json", "form": plan.kv.form, "entries": plan.kv.entries,
                          "num_blocks": plan.kv.num_blocks, "block_size": plan.kv.block_size, "dtype": plan.kv.dtype,
                          "packed": plan.kv.packed, "allocation_shape": plan.kv.allocation_shape,
                          "allocations": plan.kv.allocations, "bytes_per_rank": plan.kv.bytes_per_rank,
                          "budget": plan.budget},
                   "tail": {"file": "layout/tail.json", "vocab_per_rank": plan.dims.V_s, "hops": r.hops,
                            "k": r.tail.k},
                   "embedding": plan.scalars["embedding"]},
        "scalars": plan.scalars,
        "ranks": ranks,
        "host_files": plan.host_entries(),
        "stages": stages,
        "compile": compile_entry,
    }
    missing = [f.path for f in plan.files if f.path not in by_path]
    if missing:
        raise GkError(f"internal: shards missing from the manifest: {missing[:3]}")
    m = json.loads(json.dumps(m))  # tuples -> lists: the manifest is exactly what a reader sees
    m["build_id"] = build_id(m)
    return m


def write(path: Path, m: dict) -> None:
    """The manifest goes last and atomically: its presence says the build is complete. It is
    checked against the schema first (a no-op rebuild whose manifest is unchanged writes none)."""
    from .state import write_bytes_atomic

    validate(m)
    write_bytes_atomic(path, canonical(m))


def read_bytes(build_dir: Path) -> bytes:
    """A build's manifest bytes, refusing one over MAX_MANIFEST unread."""
    from ..jsonio import read_bounded

    p = Path(build_dir) / NAME
    try:
        return read_bounded(p, MAX_MANIFEST)
    except FileNotFoundError:
        raise GkError(f"{build_dir}: no {NAME} (not a build folder, or the build did not finish)") from None


def load(build_dir: Path) -> dict:
    """Read a build's manifest, refusing a schema version this gkbuild does not know."""
    return parse(read_bytes(build_dir), str(Path(build_dir) / NAME))


def _ranks_match_topology(m: dict, where: str) -> None:
    """``ranks`` lists every rank of the topology once, in order, at its coordinates (readers index
    it by rank)."""
    from ..layout.topology import coords

    t, ranks = m["topology"], m["ranks"]
    if len(ranks) != t["world_size"] or t["world_size"] != t["tp"] * t["dp"]:
        raise GkError(f"{where}: ranks lists {len(ranks)} ranks; its topology (TP{t['tp']} x DP{t['dp']}, world size "
                      f"{t['world_size']}) has {t['tp'] * t['dp']}")
    for i, r in enumerate(ranks):
        if {k: r[k] for k in ("rank", "dp", "tp", "ep", "vtp")} != coords(i, t["tp"], t["vtp"]).to_dict():
            raise GkError(f"{where}: ranks[{i}] is not rank {i} of its topology (TP{t['tp']} x DP{t['dp']}, "
                          f"VTP{t['vtp']})")


def parse(data: bytes, where: str) -> dict:
    """A manifest from its bytes: JSON, a schema version this gkbuild knows, the schema, and a
    ``build_id`` that is the hash of the rest (so no field was edited after the build)."""
    from ..jsonio import loads

    m = loads(data, where, MAX_MANIFEST)
    v = m.get("schema_version") if isinstance(m, dict) else None
    if v != SCHEMA_VERSION:
        raise GkError(f"{where}: schema_version {v!r} is not supported by gkbuild {__version__} "
                      f"(supports {SCHEMA_VERSION}); use a matching gkbuild")
    validate(m, where)
    _ranks_match_topology(m, where)
    if m["build_id"] != build_id(m):
        raise GkError(f"{where}: build_id {m['build_id'][:16]} is not the hash of the manifest's content "
                      f"(edited after the build?)")
    return m


def checkpoint_hash(files: list[dict]) -> str:
    """One hash for a checkpoint: its files' names and sha256s (as the manifest lists them)."""
    items = sorted((f["name"], f["sha256"]) for f in files)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def kv_meta(m: dict) -> dict:
    """The KV format a build's kernel stores (dtype and dequant scales), from its manifest, as a
    golden records it (``reference.KvFormat.from_meta`` reads it back)."""
    kv = m["layout"]["kv"]
    if kv["dtype"] == "bf16":
        return {"dtype": "bf16", "k_scale": 1.0, "v_scale": 1.0}
    rk = m["recipe"]["resolved"]["kv_cache"]
    return {"dtype": kv["dtype"], "k_scale": float(rk["k_scale"]), "v_scale": float(rk["v_scale"])}
