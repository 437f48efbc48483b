"""The shared compile cache against a real S3 server (moto on 127.0.0.1), a folder and the hub's
API: one real compile pushes both programs; a second build in a fresh folder restores them and
compiles nothing; the key follows what changes a program (compiler, flags, signature, kernel
revision) and not the weights; a cached artifact that does not verify is never used."""

import hashlib
import io
import json
import re
import zipfile

import boto3
import pytest
import s3fs
import zstandard

from gkbuild import recipe
from gkbuild.compile import cache, inductor
from gkbuild.errors import GkError
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.publish import index
from gkbuild.publish.stores import DirStore
from gkbuild.runtime import Build
from tests.conftest import RECIPES, run_cli
from tests.publish.conftest import unzstd
from tests.publish.fake_hub import FakeHub

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pushed(s3_server, tmp_path_factory):
    """The tiny cpu build compiled once, its two programs pushed to an s3 cache."""
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="gk-compile-cache")
    uri = "s3://gk-compile-cache/tiny"
    out = tmp_path_factory.mktemp("cc") / "a"
    res = compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=out, quiet=True, cache=uri, cache_push=True)
    return uri, out, res


def _stage(res, name="compile"):
    return next(s for s in res.stages if s.name == name)


@pytest.fixture
def no_compiler(monkeypatch):
    """inductor.build replaced: records what would be compiled, writes a stand-in package."""
    built = []

    def fake_build(program, sig, batch_sizes, target, path, key):
        built.append(sig.program)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"compiled here")

    monkeypatch.setattr(inductor, "build", fake_build)
    return built


def _build(out, uri, sets=(), push=False):
    return compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", list(sets)), out=out, quiet=True, cache=uri,
                         cache_push=push)


def test_a_fresh_build_with_a_warm_cache_compiles_nothing(pushed, no_compiler, tmp_path):
    uri, first, res = pushed
    assert "2 pushed" in _stage(res).detail
    again = _build(tmp_path / "b", uri)
    assert no_compiler == [] and "2 from the compile cache" in _stage(again).detail
    assert again.manifest["build_id"] == res.manifest["build_id"]  # byte-identical build
    assert problems(tmp_path / "b") == []
    Build.open(tmp_path / "b").program("decode")  # the restored package loads


def test_the_key_follows_the_program_not_the_weights(pushed, no_compiler, tmp_path, monkeypatch):
    uri, _, res = pushed
    keys = res.manifest["compile"]["cache_keys"]
    other_weights = _build(tmp_path / "w", uri, ["source=synth://tiny?layers=2&seed=1"])
    assert no_compiler == [] and other_weights.manifest["compile"]["cache_keys"] == keys
    assert other_weights.manifest["source"] != res.manifest["source"]
    tail_only = _build(tmp_path / "k", uri, ["tail.k=64"])  # a tail option: a new tail program
    assert no_compiler == ["tail"]
    k2 = tail_only.manifest["compile"]["cache_keys"]
    assert k2["decode"] == keys["decode"] and k2["tail"] != keys["tail"]
    no_compiler.clear()
    _build(tmp_path / "f", uri, ["decode.batch_sizes=[1,2]"])  # flags and signatures change
    assert no_compiler == ["decode", "tail"]
    no_compiler.clear()
    real_compiler = inductor.compiler
    monkeypatch.setattr(inductor, "compiler", lambda: {"name": "torch-aotinductor", "version": "99.0"})
    _build(tmp_path / "c", uri)
    assert no_compiler == ["decode", "tail"]
    no_compiler.clear()
    monkeypatch.setattr(inductor, "compiler", real_compiler)
    monkeypatch.setattr(cache, "kernel_revision", lambda backend, nki: "a changed twin")
    _build(tmp_path / "r", uri)
    assert no_compiler == ["decode", "tail"]


def _copy_cache(uri: str, dest: str) -> s3fs.S3FileSystem:
    fs = s3fs.S3FileSystem(use_listings_cache=False)
    src = uri.removeprefix("s3://")
    for p in fs.find(src):
        fs.copy(p, dest + p[len(src):])
    return fs


def _entry_of(fs, root: str, program: str) -> tuple[str, dict]:
    for p in fs.find(f"{root}/compile"):
        e = json.loads(fs.cat(p))
        if e["program"] == program:
            return p, e
    raise AssertionError(program)


def _flip_blob(fs, root, path, e):
    raw = bytearray(unzstd(fs.cat(f"{root}/{e['artifact']['blob']}"))
                    if e["artifact"]["encoding"] == "zstd" else fs.cat(f"{root}/{e['artifact']['blob']}"))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe(f"{root}/{e['artifact']['blob']}", zstandard.ZstdCompressor().compress(bytes(raw))
            if e["artifact"]["encoding"] == "zstd" else bytes(raw))
    e["artifact"]["stored_size"] = fs.info(f"{root}/{e['artifact']['blob']}")["size"]
    fs.pipe(path, json.dumps(e).encode())


def _forged_payload(fs, root, path, e, data=b"\x7fELF not a pt2 package"):
    """A consistent entry (hashes, sizes, blob name, the blob's header of this key and program)
    whose payload is not a package: native code that is not what the compiler makes."""
    sha = hashlib.sha256(data).hexdigest()
    blob = cache.header(e["key"], e["program"], len(data), sha) + data
    blob_sha = hashlib.sha256(blob).hexdigest()
    e["artifact"].update(sha256=sha, size=len(data), stored_size=len(blob), encoding="raw", blob_sha256=blob_sha,
                         blob=index.blob_name(blob_sha, "raw"))
    fs.pipe(f"{root}/{e['artifact']['blob']}", blob)
    fs.pipe(path, json.dumps(e).encode())


def _any_zip(fs, root, path, e):
    """A valid zip (every CRC right) that is not an AOTInductor package: refused as a .pt2."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("decode/archive_format", "zip")
        z.writestr("decode/data/aotinductor/model/model.so", b"\x7fELF")
    _forged_payload(fs, root, path, e, buf.getvalue())


def _tails_blob(fs, root, path, e):
    """The decode entry re-pointed at the tail's blob, its hashes and sizes copied: the tail's
    native code would load as decode."""
    _, tail = _entry_of(fs, root, "tail")
    e["artifact"] = tail["artifact"]
    fs.pipe(path, json.dumps(e).encode())


def _bomb(fs, root, path, e):
    big = zstandard.ZstdCompressor().compress(bytes(e["artifact"]["size"] + (4 << 20)))
    fs.pipe(f"{root}/{e['artifact']['blob']}", big)
    e["artifact"]["stored_size"] = len(big)
    fs.pipe(path, json.dumps(e).encode())


def _wrong_compiler(fs, root, path, e):
    e["artifact"]["compiler"]["version"] = "1.0"
    fs.pipe(path, json.dumps(e).encode())


def _other_key(fs, root, path, e):
    e["key"] = "0" * 64
    fs.pipe(path, json.dumps(e).encode())


def _not_json(fs, root, path, e):
    fs.pipe(path, b"{")


TAMPER = {"flipped byte": (_flip_blob, "differs from the entry"), "forged payload": (_forged_payload, "not a .pt2"),
          "any zip": (_any_zip, "not a .pt2 package of the decode program"),
          "the tail's blob": (_tails_blob, r"the blob of .*\"program\": \"tail\".*not of the key and program"),
          "zstd bomb": (_bomb, "decodes to more than"), "other compiler": (_wrong_compiler, "compiler"),
          "entry of another key": (_other_key, "is the entry of key 0000"), "not json": (_not_json, "not valid JSON")}


@pytest.mark.parametrize("case", list(TAMPER))
def test_a_cached_artifact_that_does_not_verify_is_compiled_instead(case, pushed, no_compiler, tmp_path, monkeypatch):
    warned = []
    monkeypatch.setattr(cache, "warn", warned.append)
    uri, _, _ = pushed
    root = f"gk-compile-cache/tampered-{case.replace(' ', '-')}"
    fs = _copy_cache(uri, root)
    path, e = _entry_of(fs, root, "decode")
    craft, message = TAMPER[case]
    craft(fs, root, path, e)
    res = _build(tmp_path / "b", f"s3://{root}")
    assert no_compiler == ["decode"] and (tmp_path / "b/compiled/decode.pt2").read_bytes() == b"compiled here"
    assert "1 from the compile cache" in _stage(res).detail
    assert len(warned) == 1 and warned[0].startswith("compile cache: ") and re.search(message, warned[0]), warned
    assert not list((tmp_path / "b/compiled").glob(".*partial"))


def test_cache_ls_push_and_prune(pushed, tmp_path):
    uri, first, _ = pushed
    r = run_cli("cache", "ls", uri, "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(e["program"] for e in json.loads(r.stdout)) == ["decode", "tail"]
    store = tmp_path / "folder-cache"
    r = run_cli("cache", "push", str(store), str(first))
    assert r.returncode == 0 and "2 programs pushed" in r.stderr, r.stderr
    assert "0 programs pushed" in run_cli("cache", "push", str(store), str(first)).stderr
    s = DirStore(store)
    s.put("blobs/" + "f" * 64 + ".raw", b"left by an interrupted push")
    s.put("compile/" + "e" * 64 + ".json", b"{")
    (store / "blobs" / "notes.txt").write_text("not ours")
    r = run_cli("cache", "prune", str(store), "--keep", str(first))
    assert r.returncode == 0 and "removed 1 entries and 1 blobs" in r.stderr and "2 programs kept" in r.stderr, r.stderr
    assert (store / "blobs" / "notes.txt").exists()  # a name a push never writes is never deleted
    assert sorted(e["program"] for e in cache.entries(s)) == ["decode", "tail"]
    r = run_cli("compile", str(RECIPES / "tiny-cpu.yaml"), "--out", str(tmp_path / "env"), "--json",
                env={"GKBUILD_COMPILE_CACHE": str(store)})
    assert r.returncode == 0, r.stderr
    assert "2 from the compile cache" in next(x for x in json.loads(r.stdout)["stages"] if x["name"] == "compile")["detail"]
    r = run_cli("cache", "push", str(store), str(tmp_path / "nothing"))
    assert r.returncode == 1 and r.stderr.startswith("gkbuild: error:")


def test_a_hub_cache_pushes_in_one_commit_and_restores(pushed, tmp_path):
    _, first, res = pushed
    hub = FakeHub()
    c = cache.CompileCache("hf://my-org/gk-cache", push=True, staging=tmp_path / "staging", api=hub, fs=hub)
    assert cache.push_build(c, first) == 2 and c.pushed == ["decode", "tail"]
    commits = hub.repos["my-org/gk-cache"]["main"]
    assert [sorted(p.split("/")[0] for p in c.added) for c in commits[-2:]] == [["blobs", "compile"]] * 2
    assert hub.private["my-org/gk-cache"] and not (tmp_path / "staging" / "blobs" / "x").exists()
    a = next(x for x in res.manifest["compile"]["artifacts"] if x["name"] == "tail")
    c2 = cache.CompileCache("hf://my-org/gk-cache", api=hub, fs=hub)
    dst = tmp_path / "tail.pt2"
    assert c2.restore(res.manifest["compile"]["cache_keys"]["tail"], "tail", dst, a)
    assert dst.read_bytes() == (first / a["path"]).read_bytes()


def test_keys_are_checked_before_they_name_anything(tmp_path, capsys):
    from gkbuild.cli import main

    with pytest.raises(GkError, match="not a compile key"):
        cache.entry_name("../../etc/passwd")
    with pytest.raises(SystemExit) as e:
        main(["compile", str(RECIPES / "tiny-cpu.yaml"), "--cache-push", "--out", str(tmp_path / "x")])
    assert e.value.code == 1 and "--cache-push: give the store" in capsys.readouterr().err
