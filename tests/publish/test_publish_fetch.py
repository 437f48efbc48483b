"""Publish to a folder store and fetch back: a build check passes and the runtime opens; each
refusal of a crafted store leaves only verified files; an interrupted fetch resumes."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import zstandard

from gkbuild import recipe
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.errors import GkError
from gkbuild.publish import codec, index
from gkbuild.publish.fetch import fetch
from gkbuild.publish.publish import publish
from gkbuild.publish.stores import DirStore
from gkbuild.runtime import Build
from tests.conftest import RECIPES, run_cli
from tests.publish.conftest import put_blob, read_store, rewrite, unzstd


def _build_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".gkbuild" not in p.parts}


def _only_verified(dest: Path, m: dict) -> None:
    """``dest`` holds nothing but files whose bytes match the manifest (plus fetch state), and no manifest."""
    want = {f["path"]: f["sha256"] for f in m["files"]}
    assert not (dest / mf.NAME).exists()
    for p in dest.rglob("*") if dest.exists() else []:
        rel = p.relative_to(dest).as_posix()
        if p.is_dir() or rel.startswith(".gkbuild/fetch.json"):
            continue
        assert rel in want, f"unverified {rel} left behind"
        assert hashlib.sha256(p.read_bytes()).hexdigest() == want[rel]


def test_publish_then_fetch_gives_a_build_that_checks_and_loads(built, tmp_path):
    rep = publish(built, str(tmp_path / "store"), quiet=True)
    m = mf.load(built)
    assert rep["uploaded_files"] == len(m["files"]) + 1 and not rep["already"]
    assert sorted(os.listdir(tmp_path / "store")) == ["blobs", "leases", "publish.json"]
    got = fetch(str(tmp_path / "store"), tmp_path / "got", quiet=True)
    assert got["fetched_files"] == len(m["files"])
    assert problems(tmp_path / "got") == []
    assert _build_files(tmp_path / "got") == _build_files(built)
    assert not (tmp_path / "got" / ".gkbuild").exists()
    a, b = Build.open(built).load_rank(0), Build.open(tmp_path / "got", target="cpu", world_size=1).load_rank(0)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a second fetch into the same folder is a no-op
    assert fetch(str(tmp_path / "store"), tmp_path / "got", quiet=True)["already"]


def test_republishing_uploads_nothing_and_a_change_uploads_only_what_changed(build, tmp_path):
    store = tmp_path / "store"
    publish(build, str(store), quiet=True)
    blobs = {p.name: p.stat().st_mtime_ns for p in (store / "blobs").iterdir()}
    index_before = (store / "publish.json").read_bytes()
    again = publish(build, str(store), quiet=True)
    assert again["already"] and again["uploaded_files"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in (store / "blobs").iterdir()} == blobs
    assert (store / "publish.json").read_bytes() == index_before
    # tail.k changes only the tail metadata and the manifest
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    changed = publish(build, str(store), quiet=True)
    assert changed["uploaded_files"] == 2, changed  # layout/tail.json + manifest.json
    assert len(list((store / "blobs").iterdir())) == len(blobs) + 2
    pruned = publish(build, str(store), quiet=True, prune=True)  # nothing new to store: --prune still prunes
    assert pruned["already"] and pruned["pruned"] == 2 and len(list((store / "blobs").iterdir())) == len(blobs)


def test_prune_drops_blobs_of_the_previous_build(build, tmp_path):
    store = tmp_path / "store"
    publish(build, str(store), quiet=True)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    publish(build, str(store), quiet=True, prune=True)
    idx = json.loads((store / "publish.json").read_text())
    assert {f"blobs/{p.name}" for p in (store / "blobs").iterdir()} == index.blobs(idx)


def test_a_failed_publish_leaves_the_previous_build_visible_and_no_partial(build, tmp_path, monkeypatch):
    store = tmp_path / "store"
    publish(build, str(store), quiet=True)
    before = (store / "publish.json").read_bytes()
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    real = codec.encode
    calls = []

    def failing(src, dst, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            dst.write(b"half a file")
            raise OSError("disk full")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(codec, "encode", failing)
    with pytest.raises(OSError, match="disk full"):
        publish(build, str(store), quiet=True, jobs=1)
    assert (store / "publish.json").read_bytes() == before
    assert not [p for p in store.rglob("*") if p.name.endswith(".partial")]


def test_a_build_changed_since_it_was_built_is_not_published(build, tmp_path):
    f = build / "weights" / "tail-v000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(GkError, match="tail-v000.safetensors: sha256 .* differs from the manifest"):
        publish(build, str(tmp_path / "store"), quiet=True, jobs=1)
    assert not (tmp_path / "store" / "publish.json").exists()


def test_publishing_into_a_folder_that_is_not_a_store_is_refused(built, tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(GkError, match="not empty and not a gkbuild store"):
        publish(built, str(tmp_path / "home"), quiet=True)
    assert sorted(os.listdir(tmp_path / "home")) == ["notes.txt"]


@pytest.fixture
def store(built, tmp_path) -> Path:
    s = tmp_path / "store"
    publish(built, str(s), quiet=True)
    return s


def _first_weight(idx: dict) -> dict:
    return next(e for e in idx["files"] if e["path"].startswith("weights/"))


def _tamper_content(store: Path) -> None:
    idx, _ = read_store(store)
    e = _first_weight(idx)
    good = (store / e["blob"]).read_bytes()
    raw = bytearray(unzstd(good) if e["encoding"] == "zstd" else good)
    raw[len(raw) // 2] ^= 0xFF
    stored = zstandard.ZstdCompressor().compress(bytes(raw)) if e["encoding"] == "zstd" else bytes(raw)
    (store / e["blob"]).write_bytes(stored)
    e["stored_size"] = len(stored)
    (store / index.NAME).write_bytes(index.dumps(idx))


def _escape(path: str):
    def craft(store: Path) -> None:
        idx, m = read_store(store)
        data = b"#!/bin/sh\necho owned\n"
        e = put_blob(store, data)
        m["files"].append({"path": path, "role": "metadata", "size": len(data), "sha256": e["sha256"]})
        idx["files"].append({**e, "path": path})
        rewrite(store, idx, m)
    return craft


def _unlisted(store: Path) -> None:
    idx, m = read_store(store)
    e = put_blob(store, b"extra")
    idx["files"].append({**e, "path": "weights/extra.safetensors"})
    rewrite(store, idx, m)


def _bomb(store: Path) -> None:
    idx, _ = read_store(store)
    e = _first_weight(idx)
    big = put_blob(store, bytes(e["size"] + (8 << 20)))
    (store / e["blob"]).write_bytes((store / big["blob"]).read_bytes())
    e["stored_size"] = big["stored_size"]
    (store / index.NAME).write_bytes(index.dumps(idx))


def _schema(store: Path) -> None:
    idx, m = read_store(store)
    m["schema_version"] = 99
    rewrite(store, idx, m)


def _index_version(store: Path) -> None:
    idx, _ = read_store(store)
    idx["version"] = 99
    (store / index.NAME).write_bytes(index.dumps(idx))


def _edited_manifest(store: Path) -> None:
    idx, m = read_store(store)
    m["scalars"]["eps"] = 1e-3
    rewrite(store, idx, m, fix_id=False)


def _symlinked_blob(store: Path) -> None:
    idx, _ = read_store(store)
    e = _first_weight(idx)
    target = store.parent / "elsewhere"
    os.replace(store / e["blob"], target)
    os.symlink(target, store / e["blob"])


REFUSALS = {
    "hash differs": (_tamper_content, "sha256 .* differs from the manifest"),
    "parent escape": (_escape("../outside.sh"), "would escape"),
    "absolute path": (_escape("/tmp/gk-owned.sh"), "would escape|does not match schema"),
    "state folder": (_escape(".gkbuild/state.json"), "would escape"),
    "unlisted file": (_unlisted, "weights/extra.safetensors is not listed in the manifest"),
    "zstd bomb": (_bomb, "decodes to more than"),
    "unknown schema": (_schema, "schema_version 99 is not supported"),
    "unknown index version": (_index_version, "publish index version 99 is not supported"),
    "manifest edited after build": (_edited_manifest, "build_id .* is not the hash"),
    "symlinked blob": (_symlinked_blob, "symlink"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_crafted_store_is_refused_leaving_only_verified_files(case, built, store, tmp_path):
    craft, message = REFUSALS[case]
    craft(store)
    dest = tmp_path / "got"
    with pytest.raises(GkError, match=message):
        fetch(str(store), dest, quiet=True, jobs=1)
    _only_verified(dest, mf.load(built))
    assert not (tmp_path / "outside.sh").exists() and not Path("/tmp/gk-owned.sh").exists()


def test_a_symlink_inside_the_destination_is_not_followed(store, built, tmp_path):
    dest, elsewhere = tmp_path / "got", tmp_path / "elsewhere"
    dest.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, dest / "weights")
    with pytest.raises(GkError, match="symlink"):
        fetch(str(store), dest, quiet=True, jobs=1)
    assert list(elsewhere.iterdir()) == []


def test_a_folder_with_unknown_files_or_another_build_is_refused(store, built, tmp_path):
    dest = tmp_path / "got"
    dest.mkdir()
    (dest / "mine.txt").write_text("x")
    with pytest.raises(GkError, match="holds mine.txt, which no fetch verified"):
        fetch(str(store), dest, quiet=True)
    assert os.listdir(dest) == ["mine.txt"]
    other = tmp_path / "other"
    shutil.copytree(built, other)
    m = json.loads((other / mf.NAME).read_text())
    m["name"] = "another"
    (other / mf.NAME).write_text(json.dumps(m))
    with pytest.raises(GkError, match="already holds a build"):
        fetch(str(store), other, quiet=True)


def test_expect_pins_the_build(store, built, tmp_path):
    bid = mf.load(built)["build_id"]
    with pytest.raises(GkError, match="not the expected"):
        fetch(str(store), tmp_path / "a", expect="0" * 16, quiet=True)
    assert not (tmp_path / "a").exists()
    assert fetch(str(store), tmp_path / "b", expect=bid[:12], quiet=True)["fetched_files"] > 0


def test_an_interrupted_fetch_resumes_without_refetching_verified_files(store, built, tmp_path, monkeypatch):
    dest = tmp_path / "got"
    real = codec.decode
    done = []

    def interrupt_third_file(src, dst, encoding, size, stored_size, where, *a, **k):
        if "(the manifest)" not in where:
            if len(done) == 2:
                dst.write(b"partial")
                raise KeyboardInterrupt
            done.append(where)
        return real(src, dst, encoding, size, stored_size, where, *a, **k)

    monkeypatch.setattr(codec, "decode", interrupt_third_file)
    with pytest.raises(KeyboardInterrupt):
        fetch(str(store), dest, quiet=True, jobs=1)
    m = mf.load(built)
    _only_verified(dest, m)
    first = {p.relative_to(dest).as_posix(): p.stat().st_mtime_ns for p in dest.rglob("*")
             if p.is_file() and ".gkbuild" not in p.parts}
    assert len(first) == 2
    monkeypatch.setattr(codec, "decode", real)
    reads = []
    real_open = DirStore.open_blob
    monkeypatch.setattr(DirStore, "open_blob", lambda self, name: (reads.append(name), real_open(self, name))[1])
    rep = fetch(str(store), dest, quiet=True, jobs=1)
    assert rep["reused_files"] == 2 and rep["fetched_files"] == len(m["files"]) - 2
    assert len(reads) == len(m["files"]) - 2 + 1  # the rest, and the manifest
    for rel, t in first.items():
        assert (dest / rel).stat().st_mtime_ns == t
    assert problems(dest) == []


def test_cli_publish_fetch_and_refusal_are_one_line(built, tmp_path):
    r = run_cli("publish", str(built), "--to", str(tmp_path / "s"), "-q")
    assert r.returncode == 0, r.stderr
    _tamper_content(tmp_path / "s")
    r = run_cli("fetch", str(tmp_path / "s"), "--to", str(tmp_path / "d"), "-q")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gkbuild: error:") and "differs from the manifest" in lines[0]
    r = run_cli("fetch", "gs://bucket/x", "--to", str(tmp_path / "e"))
    assert r.returncode == 1 and "unknown store" in r.stderr
