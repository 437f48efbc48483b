"""The second hostile probe's findings against a build folder, each reproduced as it was reported:
deep nesting in every JSON or YAML file read back, planted symlinks, a rebuild over tampered
files, extreme FP8 scales and sizes, golden inputs, lone-surrogate names, a huge manifest, and
remembered verification fooled by an edit that puts the mtime back."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch

from gkbuild import recipe
from gkbuild.compile import inductor
from gkbuild.errors import GkError
from gkbuild.golden import Golden
from gkbuild.layout import attention
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.fingerprint import sha256_file
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.runtime import Build
from tests.conftest import RECIPES, run_cli

TINY = str(RECIPES / "tiny-cpu.yaml")
DEEP = "[" * 200_000 + "]" * 200_000


def _compile(out, *extra, env=None):
    return run_cli("compile", TINY, "--out", str(out), "--no-compile", "-q", "-j", "1", *extra, env=env)


def _one_line(r, match: str) -> None:
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gkbuild: error:") and match in lines[0], r.stderr


# -- 1. deep nesting --------------------------------------------------------------------------------
def test_a_deeply_nested_state_or_fingerprint_file_is_set_aside_and_the_build_goes_on(build, tmp_path):
    (build / ".gkbuild" / "state.json").write_text(DEEP)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fingerprints.json").write_text(DEEP)
    r = _compile(build, env={"GKBUILD_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert "nested deeper than 64 levels" in r.stderr and "Traceback" not in r.stderr
    assert (build / ".gkbuild" / "state.json.corrupt-0").exists() and (cache / "fingerprints.json.corrupt-0").exists()
    assert problems(build) == [] and _compile(build).returncode == 0  # never blocked again


def test_deeply_nested_files_of_a_build_a_checkpoint_a_golden_and_a_recipe_are_one_line(build, tiny_copy, tmp_path):
    (build / mf.NAME).write_text(DEEP)
    _one_line(run_cli("check", str(build)), "nested deeper than 64 levels")
    _one_line(run_cli("inspect", str(build)), "nested deeper")
    for name in ("config.json", "model.safetensors.index.json"):
        ck = tmp_path / name
        shutil.copytree(tiny_copy, ck)
        (ck / name).write_text(DEEP)
        _one_line(run_cli("inspect", str(ck)), "nested deeper")
    ck = tmp_path / "header"
    shutil.copytree(tiny_copy, ck)
    f = sorted(ck.glob("*.safetensors"))[0]
    raw = (DEEP[:50_000] + DEEP[-50_000:]).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw)
    _one_line(run_cli("inspect", str(ck)), "corrupt safetensors header: nested deeper")
    g = tmp_path / "g.safetensors"
    from safetensors.torch import save_file

    from gkbuild.golden import FORMAT, TENSORS

    save_file({k: torch.zeros(1, 1, dtype=torch.int64) for k in TENSORS}, str(g),
              metadata={"format": FORMAT, "prompt_lens": "[1]", "meta": DEEP})
    with pytest.raises(GkError, match="golden metadata: nested deeper"):
        Golden.load(g)
    deep_recipe = tmp_path / "deep.yaml"
    deep_recipe.write_text("source: " + "[" * 50_000 + "]" * 50_000 + "\n")
    _one_line(run_cli("plan", str(deep_recipe)), "nested deeper than 64 levels")


# -- 2. planted symlinks ----------------------------------------------------------------------------
@pytest.mark.parametrize("link, target", [(".gkbuild/build", "victim.txt"), (".gkbuild/lock", "made.txt"),
                                          ("weights", "outside"), ("compiled", "outside"),
                                          (".gkbuild", "outside")])
def test_a_planted_symlink_is_refused_never_written_through(build, tmp_path, link, target):
    victim = tmp_path / target
    if target == "outside":
        victim.mkdir()
        if link == ".gkbuild":
            shutil.copytree(build / ".gkbuild", victim, dirs_exist_ok=True)
    elif target == "victim.txt":
        victim.write_text("mine")
    p = build / link
    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
    p.symlink_to(victim)
    before = {q: q.read_bytes() for q in tmp_path.rglob("*") if q.is_file() and build not in q.parents}
    r = _compile(build, "--set", "tail.k=64", "--force")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    after = {q: q.read_bytes() for q in tmp_path.rglob("*") if q.is_file() and build not in q.parents}
    assert after == before  # nothing outside the build was created, written or deleted
    assert not (tmp_path / "made.txt").exists()


def test_a_restore_from_the_compile_cache_never_writes_through_a_linked_compiled_folder(build, tmp_path):
    from gkbuild.compile.cache import CompileCache

    outside = tmp_path / "outside"
    outside.mkdir()
    (build / "compiled").symlink_to(outside)
    with pytest.raises(GkError, match="symlink"):
        compile_build(recipe.load(TINY), out=build, quiet=True, cache=str(tmp_path / "cache"))
    assert list(outside.iterdir()) == []
    assert CompileCache(str(tmp_path / "cache")).store.stored() == {}


# -- 3. a rebuild over tampered files ---------------------------------------------------------------
@pytest.fixture
def fake_compiler(monkeypatch):
    """inductor.build writes a deterministic stand-in: compiling is not what is tested here."""
    calls = []

    def build(program, sig, batch_sizes, target, path, key):
        calls.append(sig.key)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"PK compiled " + sig.key.encode())

    monkeypatch.setattr(inductor, "build", build)
    monkeypatch.setattr(inductor, "available", lambda target: None)
    return calls


def test_a_rebuild_re_verifies_reused_shards_layout_and_programs(build, fake_compiler):
    compile_build(recipe.load(TINY), out=build, quiet=True)
    with open(build / "compiled" / "decode.pt2", "ab") as f:
        f.write(b"PK-x")
    tail = build / "layout" / "tail.json"
    tail.write_text(tail.read_text().replace('"k": 256', '"k": 1'))
    shard = build / "weights" / "tail-v000.safetensors"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back
    res = compile_build(recipe.load(TINY, ["name=renamed"]), out=build, quiet=True)
    assert fake_compiler[:2] == ["decode", "tail"] and "decode" in fake_compiler[2:]  # the stage ran again
    assert res.shards_written == 1  # the edited shard written again
    assert problems(build) == []  # the new manifest vouches only for what was re-verified
    b = Build.open(build)
    arts = {a["name"]: a["sha256"] for a in b.manifest["compile"]["artifacts"]}
    assert arts["decode"] == sha256_file(build / "compiled" / "decode.pt2")
    assert b"PK-x" not in (build / "compiled" / "decode.pt2").read_bytes()


# -- 6, 7. extreme scales and sizes -----------------------------------------------------------------
@pytest.mark.parametrize("setting", ["kv_cache.v_scale=1.0e+300", "kv_cache.v_scale=1.0e-300",
                                     "kv_cache.k_scale=1.0e+300", "kv_cache.device_reserve_gib=1.0e+300"])
def test_extreme_scales_and_sizes_are_refused_by_the_recipe(tmp_path, setting):
    for cmd in ("plan", "compile"):
        args = [cmd, TINY, "--set", "kv_cache.dtype=fp8", "--set", setting]
        if setting.startswith("kv_cache.device_reserve"):
            args += ["--set", "kv_cache.num_blocks=null", "--set", "kv_cache.hbm_per_rank_gib=16",
                     "--set", "kv_cache.memory_utilization=0.9"]
        _one_line(run_cli(*args, "--out", str(tmp_path / "o")) if cmd == "compile" else run_cli(*args),
                  setting.split("=")[0])
        assert not (tmp_path / "o").exists()


def test_a_fold_that_overflows_or_flushes_the_weights_is_refused():
    import ml_dtypes

    w = np.array([[1e38, 1.0], [2.0, -3.0]], dtype=ml_dtypes.bfloat16)
    with np.errstate(over="ignore"), pytest.raises(GkError, match="overflows"):
        attention.check_fold(w, (w.astype(np.float32) * 16).astype(w.dtype), "W_out")
    with pytest.raises(GkError, match="underflows"):
        attention.check_fold(w, (w.astype(np.float32) * 1e-45).astype(w.dtype), "W_out")
    attention.check_fold(w, (w.astype(np.float32) * 2).astype(w.dtype), "W_out")


# -- 8. golden inputs -------------------------------------------------------------------------------
def _golden(path, **over):
    from gkbuild.reference import KvFormat

    t = {"token_ids": torch.zeros(1, 2, dtype=torch.int64), "logits": torch.zeros(1, 2, 64),
         "hidden": torch.zeros(1, 2, 2, 128), "routing": torch.zeros(1, 2, 2, 4, dtype=torch.int64),
         "router_gap": torch.zeros(1, 2, 2), "final_norm": torch.zeros(1, 2, 128), "expert_inputs": torch.zeros(4, 128),
         "expert_outputs": torch.zeros(2, 4, 4, 128)}
    t.update(over)
    Golden(**t, prompt_lens=[1], meta={"kv": KvFormat("bf16").to_meta()}).save(path)
    return path


def test_golden_inputs_are_checked_before_use(built, tmp_path):
    m = mf.load(built)["model"]
    V, E, L, H = m["vocab_size"], m["num_local_experts"], m["num_hidden_layers"], m["hidden_size"]
    shapes = dict(logits=torch.zeros(1, 2, V), hidden=torch.zeros(1, L, 2, H), router_gap=torch.zeros(1, L, 2),
                  routing=torch.zeros(1, L, 2, m["experts_per_token"], dtype=torch.int64),
                  final_norm=torch.zeros(1, 2, H), expert_inputs=torch.zeros(4, H), expert_outputs=torch.zeros(L, E, 4, H))
    bad_token = _golden(tmp_path / "t.safetensors", token_ids=torch.tensor([[0, V]]), **shapes)
    _one_line(run_cli("verify", str(built), "--golden", str(bad_token)), f"token ids reach {V}")
    routing = shapes.pop("routing") + 999
    bad_route = _golden(tmp_path / "r.safetensors", routing=routing, **shapes)
    _one_line(run_cli("verify", str(built), "--golden", str(bad_route)), "routing expert ids reach 999")
    huge = tmp_path / "huge.safetensors"  # a header declaring 18 GiB of logits, the file sparse
    n = 18 << 30
    head = json.dumps({"logits": {"dtype": "F32", "shape": [1, 1, n // 4], "data_offsets": [0, n]},
                       "__metadata__": {"format": "gkbuild-golden-2"}}).encode()
    head += b" " * (-len(head) % 8)
    with open(huge, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(8 + len(head) + n)
    _one_line(run_cli("verify", str(built), "--golden", str(huge)), "a golden is never over")
    r = run_cli("golden", "synth://tiny?layers=2", "--out", str(tmp_path / "g"), "--steps", "-1")
    assert r.returncode == 2 and "'--steps': -1 is not in the range" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("golden", "synth://tiny?layers=2", "--out", str(tmp_path / "g"), "--prompt-ids", f"1,{V}")
    _one_line(r, "token ids must be in")


# -- 11, 12. names and sizes from files --------------------------------------------------------------
def test_a_lone_surrogate_tensor_name_prints_escaped(tiny_copy):
    f = sorted(tiny_copy.glob("*.safetensors"))[0]
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    h = json.loads(data[8:8 + n])
    h["\ud800"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    raw = json.dumps(h).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    for extra in ([], ["--deep", "-q"], ["--json"]):
        r = run_cli("inspect", str(tiny_copy), *extra)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert "\\ud800" in r.stdout


def test_a_huge_manifest_is_refused_unread(build):
    with open(build / mf.NAME, "r+b") as f:
        f.truncate(3 << 30)  # sparse: no disk, and no memory unless read whole
    for cmd in ("check", "inspect"):
        _one_line(run_cli(cmd, str(build)), "refused unread")
    with pytest.raises(GkError, match="refused unread"):
        Build.open(build)


# -- remembered verification, a read-only cache ------------------------------------------------------
def test_remembered_verification_does_not_survive_an_edit_that_puts_the_mtime_back(build, tmp_path, monkeypatch):
    monkeypatch.setenv("GKBUILD_CACHE", str(tmp_path / "cache"))
    Build.open(build).load_rank(0)  # hashed and remembered
    f = build / "weights" / "tail-v000.safetensors"
    st = f.stat()
    with open(f, "r+b") as h:  # in place: same inode, same size
        h.seek(st.st_size - 1)
        last = h.read(1)
        h.seek(st.st_size - 1)
        h.write(bytes([last[0] ^ 1]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_ino, f.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    with pytest.raises(GkError, match="refused: sha256"):
        Build.open(build).load_rank(0)


def test_a_cache_that_cannot_be_written_still_loads_a_valid_build(build, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")  # a cache under a file: no one, root included, can write it
    monkeypatch.setenv("GKBUILD_CACHE", str(tmp_path / "file" / "cache"))
    b = Build.open(build)
    assert b.load_rank(0) and b.load_host() is not None


@pytest.mark.parametrize("lens", ["[0]", "[1000000000000]", '"x"', "[true]", "{}", "[NaN]", "[1, 1]", "[" * 100 + "]" * 100])
def test_hostile_prompt_lengths_in_a_golden_are_one_line(tmp_path, lens):
    """A golden's prompt lengths are data: not a list of one in-range integer a sequence, or not
    strict JSON, is one line naming the file, never a crash or a judged verify."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    path = _golden(tmp_path / "g.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    meta["prompt_lens"] = lens
    save_file(load_file(str(path)), str(path), metadata=meta)
    with pytest.raises(GkError, match=str(path)):
        Golden.load(path)
