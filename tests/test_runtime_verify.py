"""The runtime checks what it reads: hashes (remembered per host), kv.json and tail.json, pinned
build ids, paths that leave the folder, KV sizes bounded before allocation."""

import json
import shutil

import pytest

from gkbuild import recipe
from gkbuild.errors import GkError
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.runtime import Build
from tests.conftest import RECIPES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("rt") / "b"
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=out, quiet=True, compile=False)
    return out


@pytest.fixture
def build(built, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(built, dst)
    return dst


def _flip(p, at: int = -100) -> None:
    data = bytearray(p.read_bytes())
    data[at] ^= 1
    p.write_bytes(bytes(data))


def test_one_flipped_bit_in_a_shard_is_refused(build):
    _flip(build / "weights" / "attn-tp0.safetensors")
    with pytest.raises(GkError, match=r"attn-tp0.safetensors: refused: sha256 .* is not the manifest's"):
        Build.open(build).load_rank(0)
    Build.open(build, verify="size").load_rank(0)  # what the caller asked for: sizes only


def test_kv_and_tail_json_are_checked(build):
    p = build / "layout" / "kv.json"
    doc = json.loads(p.read_text())
    doc["num_blocks"] = 10**12
    p.write_text(json.dumps(doc))
    with pytest.raises(GkError, match=r"kv.json: \d+ bytes, the manifest says \d+"):
        Build.open(build).allocate_kv()
    with pytest.raises(GkError, match=r"kv.json: num_blocks is 1000000000000; expected an integer in 1..2147483648"):
        Build.open(build, verify="none").allocate_kv()
    _flip(build / "layout" / "tail.json", 5)
    with pytest.raises(GkError, match=r"tail.json: refused: sha256"):
        Build.open(build).layout_doc("tail")


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(build):
    m = json.loads((build / mf.NAME).read_text())
    m["layout"]["kv"]["num_blocks"] = 1 << 30
    for f in m["files"]:
        if f["path"] == "layout/kv.json":
            doc = json.loads((build / "layout/kv.json").read_text())
            doc["num_blocks"] = 1 << 30
            (build / "layout/kv.json").write_text(json.dumps(doc))
            f["size"] = (build / "layout/kv.json").stat().st_size
            from gkbuild.pipeline.fingerprint import sha256_file
            f["sha256"] = sha256_file(build / "layout/kv.json")
    m["build_id"] = mf.build_id(m)
    (build / mf.NAME).write_bytes(mf.canonical(m))
    with pytest.raises(GkError, match=r"the KV cache needs .* GiB, more than this host's"):
        Build.open(build).allocate_kv()


def test_expect_build_id_pins_a_build(build):
    bid = json.loads((build / mf.NAME).read_text())["build_id"]
    assert Build.open(build, expect_build_id=bid[:12]).manifest["build_id"] == bid
    with pytest.raises(GkError, match=r"not the expected 000000000000"):
        Build.open(build, expect_build_id="0" * 12)
    with pytest.raises(GkError, match=r"verify='sha1': expected one of hash, size, none"):
        Build.open(build, verify="sha1")


def test_an_absolute_artifact_path_is_refused_at_open(build):
    m = json.loads((build / mf.NAME).read_text())
    m["compile"]["artifacts"] = [{"name": "decode", "format": "aoti-pt2", "path": "/tmp/evil.pt2", "size": 1,
                                  "sha256": "0" * 64, "target": "cpu", "compiler": {"name": "x", "version": None},
                                  "flags": [], "inputs": [], "outputs": [], "status": "ok"}]
    m["build_id"] = mf.build_id(m)
    (build / mf.NAME).write_bytes(mf.canonical(m))
    with pytest.raises(GkError, match=r"path '/tmp/evil.pt2' would escape the build folder"):
        Build.open(build)


def test_verification_is_remembered_per_file(build, monkeypatch):
    from gkbuild.pipeline import fingerprint

    Build.open(build).load_rank(0)
    calls = []
    real = fingerprint.sha256_file
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    Build.open(build).load_rank(0)
    assert calls == []  # same files, same size, mtime and inode: not hashed again
    p = build / "weights" / "shared.safetensors"
    data = p.read_bytes()
    p.unlink()
    p.write_bytes(data)  # a new inode
    Build.open(build).load_rank(0)
    assert calls == [p]


def test_verify_refuses_a_build_with_one_flipped_bit_in_w_qkv(build):
    from gkbuild.checkpoint.safetensors_io import read_header
    from tests.conftest import ROOT, run_cli

    p = build / "weights" / "attn-tp0.safetensors"
    info = read_header(p).tensors["W_qkv"]
    _flip(p, info.offset + info.nbytes // 2)
    r = run_cli("verify", str(build), "--golden", str(ROOT / "goldens" / "tiny.safetensors"))
    assert r.returncode == 1
    assert "attn-tp0.safetensors: refused: sha256" in r.stderr and r.stderr.count("\n") == 1
