"""``gkbuild check``: every file re-hashed against the manifest; and a build's summary."""

from __future__ import annotations

from pathlib import Path

from ..plan import group_ranks, rank_ranges
from . import manifest as mf
from .fingerprint import sha256_file
from ..paths import RESERVED, TEMP
from .state import State


def problems(build_dir: Path, advance=lambda n: None) -> list[str]:
    """One line per mismatched, missing or extra file (empty: the build is intact)."""
    build_dir = Path(build_dir)
    m = mf.load(build_dir)
    out = []
    listed = set()
    for f in m["files"]:
        listed.add(f["path"])
        p = build_dir / f["path"]
        if not p.is_file():
            out.append(f"missing: {f['path']}")
            continue
        size = p.stat().st_size
        if size != f["size"]:
            out.append(f"size mismatch: {f['path']} is {size} bytes, manifest says {f['size']}")
            continue
        digest = sha256_file(p, advance)
        if digest != f["sha256"]:
            out.append(f"sha256 mismatch: {f['path']} is {digest}, manifest says {f['sha256']}")
    for p in sorted(build_dir.rglob("*")):
        rel = p.relative_to(build_dir).as_posix()
        if p.is_dir() or rel.split("/")[0] in RESERVED or TEMP.match(p.name):
            continue  # a temporary of gkbuild's own (a killed run's): not the build's, the next compile removes it
        if rel not in listed:
            out.append(f"extra: {rel} is not in the manifest")
    return out


def program_summary(a: dict, lnc: int) -> dict:
    """One compiled program as ``inspect`` shows it: its kernel (library@commit, entry), the
    switches it was traced with, the doctor answers it relied on, batch size, LNC, argument counts,
    NEFF header version."""
    k = a.get("kernel") or {}
    src = k.get("source") or {}
    neff = a.get("neff") or {}
    switches = {n: s["value"] for n, s in (k.get("switches") or {}).items()}
    asked = {n: s["value"] for n, s in (k.get("switches") or {}).items() if s.get("origin") == "recipe"}
    return {"name": a["name"], "program": a["program"], "batch_size": a["batch_size"], "format": a["format"],
            "status": a["status"], "lnc": neff.get("lnc_size", lnc),
            "library": (f"{src['url']}@{src['commit']}" if src.get("commit") else src.get("spec")) if src else None,
            "revision": k.get("revision"), "entry": k.get("entry"), "trace": k.get("trace"), "switches": switches,
            "switches_from_recipe": asked if k.get("switches") else k.get("switch_overrides") or {},
            "inputs": len(a["inputs"]), "outputs": len(a["outputs"]), "doctor": k.get("host_profile") or {},
            "neff_version": f"{neff['neff_version_major']}.{neff['neff_version_minor']}" if neff else None}


def code_target_note(artifacts: list[dict]) -> str | None:
    """Said once here, kept quiet at load (``inductor.quiet_portable_load``): programs compiled for
    the portable target that this wider CPU makes torch warn about."""
    from ..compile import inductor

    isas = {inductor.expected_mismatch(inductor.target_of(a.get("flags") or [])) for a in artifacts
            if a.get("format") == "aoti-pt2"} - {None}
    if not isas or "avx512f" not in inductor.cpu_features():
        return None
    return (f"the programs are compiled for the portable x86-64-v3 target ({', '.join(sorted(isas))} vectors); "
            f"this CPU has AVX-512, so torch's load-time 'Device information mismatch for AOTI_CPU_ISA' is "
            f"expected and kept quiet")


def summary(build_dir: Path) -> dict:
    m = mf.load(build_dir)
    state = State(build_dir)
    recorded = {s["name"]: s["key"] for s in m["stages"]}
    by_role: dict[str, dict] = {}
    for f in m["files"]:
        e = by_role.setdefault(f["role"], {"files": 0, "bytes": 0})
        e["files"] += 1
        e["bytes"] += f["size"]
    r0 = m["ranks"][0]
    sizes = {f["path"]: f["size"] for f in m["files"]}
    return {
        "kind": "build", "path": str(build_dir), "name": m["name"], "build_id": m["build_id"],
        "target": m["target"], "ranks": m["topology"]["world_size"],
        "topology": {k: m["topology"][k] for k in ("tp", "dp", "ep", "lnc", "vtp", "hops")},
        "files": len(m["files"]), "bytes": sum(sizes.values()), "by_role": by_role,
        "bytes_per_rank": sum(sizes[x["file"]] for x in r0["loads"]),
        "kv": m["layout"]["kv"], "tail": m["layout"]["tail"],
        "embedding": m["layout"]["embedding"]["placement"], "rope": m["scalars"]["rope"]["mode"],
        "device_memory": [{**g, "ranks": rank_ranges(g["ranks"])}
                          for g in group_ranks((r["rank"], r["device"]) for r in m["ranks"])],
        "host_files": [{**h, "bytes": sizes.get(h["file"])} for h in m["host_files"]],
        "source": {k: v for k, v in m["source"].items() if k != "files"},
        "compile": {"status": m["compile"]["status"], "artifacts": len(m["compile"]["artifacts"]),
                    "code_target": code_target_note(m["compile"]["artifacts"])},
        "programs": [program_summary(a, m["topology"]["lnc"]) for a in m["compile"]["artifacts"]],
        "stages": [{"name": n, "cached": state.stages.get(n) == k} for n, k in recorded.items()],
    }
