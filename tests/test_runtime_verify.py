"""The runtime checks what it reads: hashes (remembered per host), kv.json and tail.json, pinned
build ids, paths that leave the folder, KV sizes bounded before allocation."""

import dataclasses
import json
import shutil

import pytest

from gkbuild import recipe
from gkbuild.errors import GkError
from gkbuild.layout.kv import KvLayout
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.runtime import Build
from tests.conftest import RECIPES, run_cli
from tests.forge import forge, kv_doc

KV_FIELDS = [f.name for f in dataclasses.fields(KvLayout)]


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
    original = p.read_bytes()
    doc = json.loads(original)
    doc["num_blocks"] = 10**12
    p.write_text(json.dumps(doc))
    with pytest.raises(GkError, match=r"kv.json: \d+ bytes, the manifest says \d+"):
        Build.open(build).allocate_kv()
    with pytest.raises(GkError, match=r"kv.json: num_blocks is 1000000000000; expected an integer in 1..2147483648"):
        Build.open(build, verify="none").allocate_kv()
    p.write_bytes(original)  # opening a build checks both layouts: kv.json first
    _flip(build / "layout" / "tail.json", 5)
    with pytest.raises(GkError, match=r"tail.json: refused: sha256"):
        Build.open(build).layout_doc("tail")


def _consistent(doc: dict, **changes) -> None:
    """``kv.json`` with its scalars changed and every field derived from them following."""
    lay = dataclasses.replace(KvLayout(**{k: doc[k] for k in KV_FIELDS}), **changes)
    doc.update(json.loads(json.dumps(lay.describe())))


def _one_line(r, match: str) -> None:
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gkbuild: error:") and match in lines[0], r.stderr


def test_di_plan_of_a_forged_kv_layout_is_one_line(build):
    """The probe's cases, the manifest's hashes and build id made consistent (no signature):
    di_regions entries without offset, layers as a list of ints."""
    original = kv_doc(build)
    doc = json.loads(json.dumps(original))
    for r in doc["di_regions"]:
        del r["offset"]
    forge(build, {"layout/kv.json": doc})
    _one_line(run_cli("di", "plan", str(build), "--prefill-tp", "2"), "kv.json: di_regions is [{")
    forge(build, {"layout/kv.json": dict(original, layers=list(range(len(original["layers"]))))})
    with pytest.raises(GkError, match=r"kv.json: layers is \[0, 1\]"):
        Build.open(build)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["di_regions"][1].update(offset=d["di_regions"][1]["offset"] + 2), r"kv.json: di_regions is"),
    (lambda d: d.update(entries=d["entries"] + 1), r"kv.json: entries is 3; its form, num_layers"),
    (lambda d: d["kv_heads_of_rank"].update({"0": [1, 0]}), r"kv.json: kv_heads_of_rank is \{'0': \[1, 0\]\}; "
                                                             r"the manifest's model, topology and recipe give"),
    (lambda d: _consistent(d, num_layers=4), r"kv.json: num_layers is 4; the manifest's model"),
    (lambda d: _consistent(d, head_dim=32), r"kv.json: head_dim is 32; the manifest's model"),
    (lambda d: d.update(extra=1), r"kv.json: unexpected field 'extra'"),
])
def test_a_kv_layout_is_checked_whole_when_a_build_is_opened(build, edit, match):
    """Every field is what the scalars give, and the scalars are what the manifest says."""
    doc = kv_doc(build)
    edit(doc)
    forge(build, {"layout/kv.json": doc})
    with pytest.raises(GkError, match=match):
        Build.open(build)


def test_a_tail_layout_is_what_the_manifest_gives(build):
    doc = json.loads((build / "layout" / "tail.json").read_text())
    doc["owned_rows"]["1"]["0"] = [5]
    forge(build, {"layout/tail.json": doc})
    with pytest.raises(GkError, match=r"tail.json: owned_rows is .*; the manifest's topology and batch sizes give"):
        Build.open(build)


def test_a_manifest_without_its_ranks_is_one_line(build):
    forge(build, edit=lambda m: m.update(ranks=[]))
    _one_line(run_cli("inspect", str(build)), "manifest.json: ranks lists 0 ranks; its topology (TP1 x DP1, world")
    with pytest.raises(GkError, match="ranks lists 0 ranks"):
        Build.open(build)


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(build):
    doc = kv_doc(build)
    _consistent(doc, num_blocks=1 << 30)

    def bigger(m):
        m["layout"]["kv"].update({k: doc[k] for k in ("num_blocks", "allocation_shape", "bytes_per_rank")})
    forge(build, {"layout/kv.json": doc}, bigger)
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
