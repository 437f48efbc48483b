"""``gkbuild publish``: a build into a store, each file once.

Every file is re-hashed as it is stored and checked against the manifest, so a build that
changed on disk since it was made is refused rather than published. Files whose content the
store already holds (same sha256) are not stored again: republishing a build uploads nothing,
and a rebuild that changed only the tail shards uploads only those.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from ..errors import GkError
from ..jsonio import open_regular
from ..paths import PROVENANCE, SIGNATURE
from ..pipeline import manifest as mf
from ..pipeline.state import STATE_DIR
from ..progress import bar, warn
from . import codec, index, signing
from .leases import Lease, blocked, dead, others_alive
from .parallel import run_each
from .stores import live_blobs, open_store


def _stored_entry(f: dict, stored: dict[str, int], store) -> dict | None:
    """The index entry for a file whose content is already in the store, if it is, intact: a
    directory store's blob is decoded and hashed first (a disk or a hand can change it; a rotten
    blob is then stored again, which repairs it). The hub checks LFS content itself."""
    for enc in (codec.ZSTD, codec.RAW):
        name = index.blob_name(f["sha256"], enc)
        if name in stored:
            e = index.entry(f["path"], f["size"], f["sha256"], enc, stored[name])
            if not store.verifies_blobs:
                return e
            try:
                with store.open_blob(name) as src, open(os.devnull, "wb") as sink:
                    if codec.decode(src, sink, enc, f["size"], stored[name], name) == f["sha256"]:
                        return e
            except GkError:
                pass
            warn(f"{store.uri}/{name}: does not hold the content its name says; storing it again")
    return None


def put_blob(f: dict, stored: dict[str, int], store, level: int = codec.LEVEL,
             advance=lambda n: None) -> tuple[dict, str | None, int]:
    """Store file ``f`` (its path, size, sha256 and local ``src``) as a blob unless the store holds
    it intact: (its index entry, the blob's name if it was sent else None, bytes sent). The bytes
    are hashed as they go and must be the ``sha256`` given."""
    e = _stored_entry(f, stored, store)
    if e is not None:
        return e, None, 0
    enc, _ = codec.choose(f["src"], level)
    name = index.blob_name(f["sha256"], enc)
    with store.writer(name) as out, open_regular(f["src"], buffering=0) as src:
        got, stored_size = codec.encode(src, out, enc, level, advance=advance)
        if got != f["sha256"]:
            raise GkError(f"{f['src']}: sha256 {got[:16]} differs from the manifest's {f['sha256'][:16]} "
                          f"(changed since it was built); run gkbuild check, rebuild, then publish")
    return index.entry(f["path"], f["size"], f["sha256"], enc, stored_size), name, stored_size


def publish(build_dir: Path, dest: str, level: int = codec.LEVEL, jobs: int | None = None, prune: bool = False,
            quiet: bool = False, api=None, fs=None, sign: str | None = None) -> dict:
    """Publish ``build_dir`` to ``dest`` (a folder, ``hf://org/name[@branch]`` or ``s3://``); returns a
    report. ``sign``: a private key's PEM file, or ``sigstore`` (keyless, CI's OIDC identity): the
    signature and provenance go beside the manifest, in the build folder and in the store. Without
    it, a signature the build folder already has is published if it is over exactly this manifest
    and its provenance (who signed it, a fetch with --trust checks); else it is left out, with a
    warning."""
    build_dir = Path(build_dir)
    built = signed_build(build_dir, sign)
    store = open_store(dest, staging=build_dir / STATE_DIR / "publish", api=api, fs=fs)
    if not store.leases:
        return _publish(built, store, level, jobs, prune, quiet, None)
    store.prepare()  # refuses a folder that is not a store before the lease is written into it
    with Lease(store) as lease:  # taken before the store is listed: a --prune elsewhere sees this publish
        return _publish(built, store, level, jobs, prune, quiet, lease)


def signed_build(build_dir: Path, sign: str | None) -> tuple:
    """(folder, manifest bytes, manifest, signature) of a build, signed first with ``sign``."""
    man_bytes = mf.read_bytes(build_dir)
    m = mf.parse(man_bytes, str(build_dir / mf.NAME))
    if sign:
        prov = signing.dumps(signing.provenance(m, man_bytes))
        signing.write_folder(build_dir, (signing.sign(man_bytes, prov, sign), prov))
    signed = signing.read_folder(build_dir)
    why = signing.mismatch(man_bytes, signed) if signed is not None else None
    if why:  # a signature carried in from elsewhere: never published beside a manifest it does not sign
        warn(f"{build_dir / SIGNATURE}: {why}; publishing the build unsigned (sign it with --sign)")
        signed = None
    return build_dir, man_bytes, m, signed


def _publish(built: tuple, store, level: int, jobs: int | None, prune: bool, quiet: bool, lease,
             known: dict[str, dict] | None = None) -> dict:
    """``known``: path -> index entry of files the caller already stored (a streamed build's
    shards, which are not in ``build_dir``)."""
    build_dir, man_bytes, m, signed = built
    known = known or {}
    prev_bytes = store.read_index()
    prev = index.parse(prev_bytes, f"{store.uri}/{index.NAME}") if prev_bytes is not None else None
    stored = store.stored()
    files = [{**f, "src": build_dir / f["path"]} for f in m["files"]]
    report = {"store": store.uri, "build_id": m["build_id"], "name": m["name"], "files": len(files),
              "uploaded_files": 0, "uploaded_bytes": 0, "raw_bytes": sum(f["size"] for f in files), "entries": []}
    sig_sha = hashlib.sha256(signed[0]).hexdigest() if signed else None
    if (prev is not None and prev.get("build_id") == m["build_id"] and index.blobs(prev) <= stored.keys()
            and not store.verifies_blobs and prev.get("signature", {}).get("sha256") == sig_sha):
        report.update(already=True, entries=prev["files"], where=store.uri)
        return _tidy(report, store, prune, lease)
    for f in (f for f in files if f["path"] not in known):
        size = f["src"].stat().st_size if f["src"].is_file() else None
        if size != f["size"]:
            raise GkError(f"{f['src']}: {'missing' if size is None else f'{size} bytes'}, the manifest says "
                          f"{f['size']}; run gkbuild check (or rebuild) before publishing")
    store.prepare()
    man_sha = hashlib.sha256(man_bytes).hexdigest()
    man = {"path": mf.NAME, "size": len(man_bytes), "sha256": man_sha, "src": build_dir / mf.NAME}
    beside = [{"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "src": build_dir / name}
              for name, data in zip((SIGNATURE, PROVENANCE), signed or ())]
    groups: dict[str, list[dict]] = {}  # files with the same content share one blob
    for f in [man, *beside, *files]:
        groups.setdefault(f["sha256"], []).append(f)
    entries, added, lock = {}, [], threading.Lock()
    todo = list(groups.values())

    def store_one(same: list[dict]) -> None:
        if lease:
            lease.renew()
        done = next((known[g["path"]] for g in same if g["path"] in known), None)
        e, name, sent = (done, None, 0) if done else put_blob(same[0], stored, store, level, advance)
        with lock:
            if name:
                added.append(name)
                report["uploaded_files"] += 1
                report["uploaded_bytes"] += sent
            entries.update({g["path"]: {**e, "path": g["path"]} for g in same})

    with bar(f"publish {m['name']}", sum(same[0]["size"] for same in todo), quiet) as advance:
        run_each(store_one, todo, jobs or os.cpu_count() or 1, on_failure=store.discard)
    man_entry, *signed_entries = ({k: v for k, v in entries.pop(name).items() if k != "path"}
                                  for name in (mf.NAME, *(b["path"] for b in beside)))
    idx = index.make(m, man_entry, list(entries.values()), dict(zip(index.SIGNED, signed_entries)))
    if not added and prev is not None and index.dumps(idx) == prev_bytes:  # every blob checked, none missing
        report.update(already=True, entries=prev["files"], where=store.uri)
        return _tidy(report, store, prune, lease)
    if lease:
        gone = sorted(index.blobs(idx) - store.stored().keys())
        if gone:  # a prune that started before this publish's lease removed a blob it reuses
            raise GkError(f"{store.uri}: {gone[0]} vanished while publishing (a concurrent --prune?); nothing of "
                          f"this publish is visible: run it again")
    message = f"gkbuild publish {m['name']} build {m['build_id'][:16]}"
    report.update(already=False, entries=idx["files"], where=store.commit(index.dumps(idx), added, message))
    if prev is not None and prev.get("build_id") != m["build_id"]:  # a store holds one build: the last published
        report["replaced"] = {"name": prev.get("name"), "build_id": prev.get("build_id")}
    return _tidy(report, store, prune, lease)


def _tidy(report: dict, store, prune: bool, lease) -> dict:
    """After a publish succeeds, whether it sent anything or the store held the build already:
    the leases of dead publishes go (so a killed run's own lease stops blocking prunes), and with
    no other publish live, the temporaries they left; with ``prune``, unnamed blobs too."""
    if lease is None:
        return report
    if prune:
        report["pruned"] = prune_store(store, lease)
    elif not others_alive(store, lease.name):
        leftovers = store.temporaries() + dead(store)
        store.delete(leftovers)
        report["tidied"] = len(leftovers)
    return report


def prune_store(store, lease: Lease) -> int:
    """After a commit: delete the blobs the store's current index (re-read: another publish may
    have committed since) and its compile cache do not name, temporaries and dead leases;
    nothing while another publish holds a live lease. How many files it removed."""
    others = others_alive(store, lease.name)
    if others:
        warn(blocked(store, others, "blobs"))
        return 0
    keep = live_blobs(store, store.read_index())
    gone = sorted(n for n in store.stored() if n not in keep) + store.temporaries()
    store.delete(gone + dead(store))
    return len(gone)
