"""The second hostile probe's findings against stores, caches and fetches: deep nesting in every
record and index, blob and entry folders linked outside, concurrent --prune, the S3 mirror's
record, a prefix where the index should be, killed downloads, and a cache sharing a store."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import boto3
import pytest

from gkbuild import recipe
from gkbuild.checkpoint import s3_source
from gkbuild.compile import cache
from gkbuild.errors import GkError
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.publish import index
from gkbuild.publish.fetch import RECORD, fetch
from gkbuild.publish.publish import publish
from gkbuild.publish.stores import DirStore
from tests.conftest import RECIPES, ROOT, run_cli
from tests.publish.fake_hub import FakeHub

DEEP = b"[" * 200_000 + b"]" * 200_000


def test_deeply_nested_store_files_and_records_are_one_line_or_set_aside(build, tmp_path, monkeypatch):
    store = tmp_path / "store"
    publish(build, str(store), quiet=True)
    good = (store / index.NAME).read_bytes()
    (store / index.NAME).write_bytes(DEEP)
    with pytest.raises(GkError, match="publish.json: nested deeper than 64 levels"):
        fetch(str(store), tmp_path / "a", quiet=True)
    idx = json.loads(good)
    idx["manifest"] = {"size": len(DEEP), "sha256": hashlib.sha256(DEEP).hexdigest(), "encoding": "raw",
                       "stored_size": len(DEEP), "blob": index.blob_name(hashlib.sha256(DEEP).hexdigest(), "raw")}
    (store / idx["manifest"]["blob"]).write_bytes(DEEP)
    (store / index.NAME).write_bytes(index.dumps(idx))
    with pytest.raises(GkError, match=r"\(the manifest\): nested deeper"):
        fetch(str(store), tmp_path / "b", quiet=True)
    (store / index.NAME).write_bytes(good)
    dest = tmp_path / "c"
    (dest / ".gkbuild").mkdir(parents=True)
    (dest / RECORD).write_bytes(DEEP)  # an interrupted fetch's record: set aside, the fetch goes on
    fetch(str(store), dest, quiet=True)
    assert problems(dest) == []
    cache_store = tmp_path / "cc"
    DirStore(cache_store).put(cache.entry_name("e" * 64), DEEP)
    warned = []
    monkeypatch.setattr(cache, "warn", warned.append)
    assert not cache.CompileCache(str(cache_store)).restore("e" * 64, "decode", tmp_path / "x.pt2", {})
    assert len(warned) == 1 and "nested deeper" in warned[0] and "compiling decode instead" in warned[0]


def test_blob_and_entry_folders_linked_outside_are_refused_for_writes_and_deletes(build, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    bait = outside / ("a" * 64 + ".raw")  # a blob-named file a prune would delete
    bait.write_bytes(b"mine")
    store = tmp_path / "store"
    store.mkdir()
    (store / "blobs").symlink_to(outside)
    r = run_cli("publish", str(build), "--to", str(store), "--prune")
    assert r.returncode == 1 and "symlink" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(os.listdir(outside)) == [bait.name] and bait.read_bytes() == b"mine"
    cstore = tmp_path / "cache"
    cstore.mkdir()
    (cstore / "compile").symlink_to(outside)
    with pytest.raises(GkError, match="symlink"):
        cache.prune(DirStore(cstore))
    with pytest.raises(GkError, match="symlink"):
        DirStore(cstore).put(cache.entry_name("b" * 64), b"{}")
    (cstore / "compile").unlink()
    (cstore / "blobs").symlink_to(outside)
    with pytest.raises(GkError, match="symlink"):
        cache.prune(DirStore(cstore))
    assert sorted(os.listdir(outside)) == [bait.name]


def test_concurrent_prunes_into_one_folder_store_never_break_its_index(built, tmp_path):
    builds = []
    for k in (32, 64):
        b = tmp_path / f"b{k}"
        shutil.copytree(built, b)
        compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", [f"tail.k={k}"]), out=b, quiet=True, compile=False)
        builds.append(b)
    store = tmp_path / "store"
    publish(built, str(store), quiet=True)
    for trial in range(3):
        procs = [subprocess.Popen([sys.executable, "-m", "gkbuild", "publish", str(b), "--to", str(store), "--prune",
                                   "-q", "-j", "1"], cwd=ROOT, stderr=subprocess.PIPE, text=True) for b in builds]
        errs = [p.communicate(timeout=300)[1] for p in procs]
        assert all(p.returncode in (0, 1) for p in procs), errs
        assert all("Traceback" not in e for e in errs), errs
        got = tmp_path / f"got{trial}"
        fetch(str(store), got, quiet=True)  # whichever committed last: every blob its index names is there
        assert problems(got) == []
        assert os.listdir(store / "leases") == []


def test_a_cache_and_a_build_store_sharing_a_folder_keep_each_others_blobs(build, tmp_path):
    store = tmp_path / "shared"
    publish(build, str(store), quiet=True)
    s = DirStore(store)
    a = {"format": "aoti-pt2", "target": "cpu", "compiler": {"name": "x", "version": "1"}, "flags": [],
         "size": 3, "sha256": "c" * 64}
    blob = "blobs/" + "f" * 64 + ".raw"
    s.put(blob, b"xyz")
    s.put(cache.entry_name("e" * 64), index.dumps(cache.make_entry("e" * 64, "decode", a, "raw", 3, "f" * 64)))
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    publish(build, str(store), quiet=True, prune=True)
    assert (store / blob).exists()  # the cache's blob survives the build store's prune
    cache.prune(s)
    idx = json.loads((store / index.NAME).read_text())
    assert all((store / b).exists() for b in index.blobs(idx))  # the build's survive the cache's prune
    fetch(str(store), tmp_path / "got", quiet=True)


def test_a_hub_store_re_hashes_a_blob_it_reuses(build):
    hub = FakeHub()
    publish(build, "hf://org/gk", api=hub, fs=hub, quiet=True)
    reads = len(hub.reads)
    again = publish(build, "hf://org/gk", api=hub, fs=hub, quiet=True)
    assert again["already"] and len(hub.reads) > reads  # the blobs were read back and hashed


def test_a_cache_push_that_fails_is_a_warning_and_a_rerun_compiles_nothing(build, tmp_path, monkeypatch):
    from gkbuild.compile import inductor

    calls = []

    def fake(program, sig, batch_sizes, target, path, key):
        calls.append(sig.key)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"PK " + sig.key.encode())

    monkeypatch.setattr(inductor, "build", fake)
    monkeypatch.setattr(inductor, "available", lambda target: None)
    (tmp_path / "file").write_text("")
    ro = str(tmp_path / "file" / "cache")  # a cache no one can write into
    warned = []
    monkeypatch.setattr("gkbuild.compile.stage.warn", warned.append)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=build, quiet=True, cache=ro, cache_push=True)
    assert any("pushing to" in w and "failed" in w for w in warned), warned
    n = len(calls)
    res = compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=build, quiet=True, cache=ro, cache_push=True)
    assert len(calls) == n and not res.did_work


def test_cache_prune_keep_refuses_a_build_without_compile_keys(build, tmp_path):
    store = tmp_path / "cache"
    DirStore(store).put(cache.entry_name("e" * 64), b"{}")
    r = run_cli("cache", "prune", str(store), "--keep", str(build))
    assert r.returncode == 1 and "no compiled programs" in r.stderr
    assert (store / cache.entry_name("e" * 64)).exists()


def test_a_late_killed_fetchs_record_temporary_is_removed(build, tmp_path):
    store = tmp_path / "store"
    publish(build, str(store), quiet=True)
    dest = tmp_path / "d"
    (dest / ".gkbuild").mkdir(parents=True)
    (dest / ".gkbuild" / ".fetch.json.4242.partial").write_text("{")
    fetch(str(store), dest, quiet=True)
    assert not (dest / ".gkbuild").exists() and problems(dest) == []


# -- S3 --------------------------------------------------------------------------------------------
def test_an_s3_prefix_holding_only_publish_json_slash_x_is_one_line(build, bucket, s3_server, tmp_path):
    boto3.client("s3", endpoint_url=s3_server).put_object(Bucket=bucket, Key="P/publish.json/x", Body=b"x")
    for r in (run_cli("fetch", f"s3://{bucket}/P", "--to", str(tmp_path / "d")),
              run_cli("publish", str(build), "--to", f"s3://{bucket}/P")):
        assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "publish.json" in r.stderr


@pytest.mark.parametrize("record", [{"config.json": "a string"}, {"config.json": {"etag": "x", "size": 1,
                                                                                   "sha256": "0" * 64}},
                                    DEEP.decode()])
def test_a_hostile_s3_mirror_record_is_set_aside(tiny_ckpt, bucket, s3_server, record):
    client = boto3.client("s3", endpoint_url=s3_server)
    client.upload_file(str(tiny_ckpt / "config.json"), bucket, "ck/config.json")
    uri = f"s3://{bucket}/ck"
    d = s3_source.cache_dir(s3_source.s3.parse(uri))
    d.mkdir(parents=True, exist_ok=True)
    (d / s3_source.RECORD).write_text(record if isinstance(record, str) else json.dumps(record))
    assert s3_source.fetch_config(uri).read_bytes() == (tiny_ckpt / "config.json").read_bytes()
    assert (d / f"{s3_source.RECORD}.corrupt-0").exists()


def test_a_killed_s3_download_leaves_no_partial_behind_for_good(tiny_ckpt, bucket, s3_server):
    client = boto3.client("s3", endpoint_url=s3_server)
    client.upload_file(str(tiny_ckpt / "config.json"), bucket, "k/config.json")
    uri = f"s3://{bucket}/k"
    d = s3_source.cache_dir(s3_source.s3.parse(uri))
    d.mkdir(parents=True, exist_ok=True)
    torn = d / ".config.json.4242.partial"  # a download killed after it wrote the whole file
    torn.write_bytes((tiny_ckpt / "config.json").read_bytes())
    s3_source.fetch_config(uri)
    assert not torn.exists()
