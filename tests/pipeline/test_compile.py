"""gkbuild compile end to end on the tiny-topology TP8 x DP16 x EP128 build and the tiny cpu one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from gkbuild import recipe
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.checkpoint import names
from gkbuild.checkpoint.reader import Checkpoint
from gkbuild.checkpoint.safetensors_io import read_header
from gkbuild.checkpoint.source import materialize, parse
from gkbuild.errors import GkError
from gkbuild.kernels import rope
from gkbuild.layout import attention, embedding, experts_bf16, experts_mx, replicated, tail
from gkbuild.plan import make_plan
from tests.compile.conftest import LIB_A
from tests.conftest import RECIPES, run_cli


def materialize_config(r):
    from gkbuild.model import GptOssConfig

    return GptOssConfig.from_file(materialize(parse(r.source)) / "config.json")


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".gkbuild" not in p.parts}


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml")
    out = tmp_path_factory.mktemp("build") / "topo"
    res = compile_build(r, out=out, quiet=True, compile=False)
    return r, out, res


def _expected(r, ck, plan, f) -> dict[str, np.ndarray]:
    """What a shard must hold: the layout functions applied to the source, stacked."""
    d = plan.dims
    L = d.L
    p = names.layer_prefix
    rd = lambda n, *a: np.array(ck.read(n, *a))  # noqa: E731
    st = lambda fn: np.stack([fn(i) for i in range(L)])  # noqa: E731
    if f.role == "shared":
        return {
            "input_layernorm_weight": st(lambda i: replicated.row(d, rd(p(i) + "input_layernorm.weight"))),
            "post_attn_layernorm_weight": st(lambda i: replicated.row(d, rd(p(i) + "post_attention_layernorm.weight"))),
            "bias_out": st(lambda i: attention.o_bias(d, rd(p(i) + "self_attn.o_proj.bias"))),
            "router_weights": st(lambda i: replicated.router_weights(d, rd(p(i) + "mlp.router.weight"))),
            "router_bias": st(lambda i: replicated.router_bias(rd(p(i) + "mlp.router.bias"))),
            "gamma": replicated.gamma(d, rd(names.FINAL_NORM)),
            **({"inv_freq": rope.inv_freq(d.d, plan.scalars["rope"]).numpy()[:, None]}
               if r.decode.rope == "fused" else {}),
        }
    if f.role == "embed":
        table = embedding.table(d, rd(names.EMBED))
        placement = r.decode.embedding
        if placement == "host":
            return {"embed_tokens": table}
        return {"embed_weight": embedding.vocab_shard(table, f.index, d.tp) if placement == "vocab"
                else embedding.hidden_shard(table, f.index, d.tp)}
    if f.role == "attn":
        t = f.index

        (q0, q1), (k0, k1) = attention.heads(d, t)

        def rows(i, x, y):  # the whole tensor read, then the rank's heads cut from it
            h0, h1 = (q0, q1) if x == "q" else (k0, k1)
            return rd(p(i) + f"self_attn.{x}_proj.{y}")[h0 * d.d:h1 * d.d]

        return {"W_qkv": st(lambda i: attention.qkv_weight(d, *(rows(i, x, "weight") for x in "qkv"))),
                "bias_qkv": st(lambda i: attention.qkv_bias(*(rows(i, x, "bias") for x in "qkv"))),
                "W_out": st(lambda i: attention.w_out(d, t, rd(p(i) + "self_attn.o_proj.weight"))),
                "sink": st(lambda i: attention.sink(rd(p(i) + "self_attn.sinks")[q0:q1]))}
    if f.role == "expert":
        lo, hi = f.index * d.E_L, (f.index + 1) * d.E_L
        e = lambda i, n: rd(p(i) + "mlp.experts." + n, lo, hi)  # noqa: E731
        if r.experts == "bf16":
            from gkbuild.checkpoint.mxfp4 import decode

            gu = [experts_bf16.gate_up(d, decode(e(i, "gate_up_proj_blocks"), e(i, "gate_up_proj_scales")),
                                       e(i, "gate_up_proj_bias")) for i in range(L)]
            dn = [experts_bf16.down(d, decode(e(i, "down_proj_blocks"), e(i, "down_proj_scales")),
                                    e(i, "down_proj_bias")) for i in range(L)]
            return {"expert_gate_up_weights": np.stack([x[0] for x in gu]),
                    "expert_gate_up_bias": np.stack([x[1] for x in gu]),
                    "expert_down_weights": np.stack([x[0] for x in dn]),
                    "expert_down_bias": np.stack([x[1] for x in dn])}
        gu = [experts_mx.gate_up(d, e(i, "gate_up_proj_blocks"), e(i, "gate_up_proj_scales"),
                                 e(i, "gate_up_proj_bias")) for i in range(L)]
        dn = [experts_mx.down(d, e(i, "down_proj_blocks"), e(i, "down_proj_scales"), e(i, "down_proj_bias"))
              for i in range(L)]
        return {"expert_gate_up_weights": np.stack([x[0] for x in gu]),
                "expert_gate_up_weights_scale": np.stack([x[1] for x in gu]),
                "expert_gate_up_bias": np.stack([x[2] for x in gu]),
                "expert_down_weights": np.stack([x[0] for x in dn]),
                "expert_down_weights_scale": np.stack([x[1] for x in dn]),
                "expert_down_bias": np.stack([x[2] for x in dn])}
    return {"lm_head_weight_t": tail.lm_head_t(d, f.index, rd(names.LM_HEAD))}


def _assert_shard(out, f, want):
    h = read_header(out / f.path)
    assert {n: (t.shape, t.dtype.name) for n, t in h.tensors.items()} == \
        {t.name: (t.shape, t.dtype) for t in f.tensors}
    raw = (out / f.path).read_bytes()
    for name, arr in want.items():
        info = h.tensors[name]
        got = raw[info.offset:info.offset + info.nbytes]
        assert got == np.ascontiguousarray(arr).tobytes(), f"{f.path}:{name}"


def test_shards_are_the_layout_functions_of_the_source(topo):
    r, out, _ = topo
    root = materialize(parse(r.source))
    ck = Checkpoint.open(root)
    plan = make_plan(r, ck.config)
    assert sorted(p.relative_to(out / "weights").as_posix() for p in (out / "weights").iterdir()) == \
        sorted(Path(f.path).name for f in plan.files)
    by_path = {f.path: f for f in plan.files}
    for path in ("weights/shared.safetensors", "weights/attn-tp3.safetensors", "weights/expert-017.safetensors",
                 "weights/expert-127.safetensors", "weights/tail-v042.safetensors", "weights/embed-host.safetensors"):
        _assert_shard(out, by_path[path], _expected(r, ck, plan, by_path[path]))


@pytest.mark.parametrize("sets, paths", [
    (["decode.embedding=vocab", "decode.rope=fused"],
     ["weights/embed-vocab-tp0.safetensors", "weights/embed-vocab-tp5.safetensors", "weights/shared.safetensors"]),
    (["decode.embedding=hidden"], ["weights/embed-tp0.safetensors", "weights/embed-tp5.safetensors"]),
], ids=["vocab-fused", "hidden"])
def test_embedding_placements_are_the_layout_functions_of_the_source(tmp_path, sets, paths):
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml", sets)
    out = tmp_path / "b"
    compile_build(r, out=out, quiet=True, compile=False)
    ck = Checkpoint.open(materialize(parse(r.source)))
    plan = make_plan(r, ck.config)
    by_path = {f.path: f for f in plan.files}
    for path in paths:
        _assert_shard(out, by_path[path], _expected(r, ck, plan, by_path[path]))
    m = mf.load(out)
    assert m["host_files"] == []
    r77 = m["ranks"][77]
    assert r77["loads"][-1]["file"] == (paths[1] if "vocab" in sets[0] else "weights/embed-tp5.safetensors")
    assert r77["device"]["weights_bytes"] == plan.weight_bytes(77)
    assert m["layout"]["embedding"]["placement"] == r.decode.embedding


def test_shards_open_with_the_official_reader(topo):
    _, out, _ = topo
    with safe_open(str(out / "weights/expert-005.safetensors"), framework="pt") as f:
        t = f.get_tensor("expert_gate_up_weights")
        assert tuple(t.shape) == (2, 1, 128, 2, 1, 512)
    with safe_open(str(out / "weights/shared.safetensors"), framework="numpy") as f:
        assert f.get_tensor("gamma").dtype == np.float32


def test_manifest(topo):
    r, out, res = topo
    m = mf.load(out)  # validates against the shipped schema
    assert m["schema_version"] == 2 and m["target"] == "trn3" and m["topology"]["world_size"] == 128
    assert m["build_id"] == mf.build_id(m)
    assert m["recipe"]["digest"] == r.digest()
    assert m["source"]["kind"] == "synth" and len(m["source"]["files"]) >= 3
    assert all(len(f["sha256"]) == 64 for f in m["source"]["files"])
    assert m["topology"]["meshes"]["tp_replica_group"][3] == list(range(24, 32))
    assert m["topology"]["meshes"]["tail_hop_meshes"][1][0] == list(range(0, 128, 8))
    r77 = m["ranks"][77]
    assert (r77["dp"], r77["tp"], r77["ep"], r77["vtp"]) == (9, 5, 77, 77)
    assert [x["file"] for x in r77["loads"]] == ["weights/shared.safetensors", "weights/attn-tp5.safetensors",
                                                 "weights/expert-077.safetensors", "weights/tail-v077.safetensors"]
    assert "expert_gate_up_weights" in r77["loads"][2]["tensors"]
    # the embedding is host-side: in no rank's device loads, listed apart with its program
    assert all("embed_tokens" not in x["tensors"] for rk in m["ranks"] for x in rk["loads"])
    assert m["host_files"] == [{"file": "weights/embed-host.safetensors", "tensors": ["embed_tokens"],
                                "program": "decode", "use": m["host_files"][0]["use"]}]
    files = {f["path"]: f for f in m["files"]}
    assert files["weights/embed-host.safetensors"]["role"] == "embed"
    dev = r77["device"]
    assert dev["weights_bytes"] == sum(t.nbytes for f in make_plan(r, materialize_config(r)).files_of(77)
                                       for t in f.tensors)
    assert dev["total_bytes"] == dev["weights_bytes"] + dev["kv_bytes"] + dev["reserve_bytes"]
    assert {f["path"] for f in m["files"]} >= {"layout/kv.json", "layout/tail.json", "weights/shared.safetensors"}
    assert m["compile"]["status"].startswith("skipped") and m["compile"]["artifacts"] == []
    assert m["tools"]["gkbuild"] and m["tools"]["python"] and m["tools"]["torch"]
    kv = json.loads((out / "layout/kv.json").read_text())
    assert kv["form"] == "stacked" and kv["entries"] == 2 and kv["k_shape"] == [2, 96, 1, 2, 32, 2]
    assert len(kv["di_regions"]) == 4 and kv["di_regions"][2] == {"entry": 1, "half": "K", "tensor": "K_cache", "offset": 96 * 4 * 32, "block_len": 4 * 32, "count": 96, "layers": [1]}
    assert kv["update_indices"] == ["full"] and kv["kv_heads_of_rank"]["9"] == [1] and "N-1" in kv["swa_di_truncation"]
    b = kv["budget"]
    assert (b["mode"], b["num_blocks"], b["reserve_bytes"]) == ("given", 96, 2**30)
    assert b["device_bytes"] == dev["total_bytes"] and b["host_bytes"] == 2048 * 512 * 2
    t = json.loads((out / "layout/tail.json").read_text())
    assert t["owned_rows"]["128"]["9"] == [17]  # hop digits (9 % 8, 9 // 8) = (1, 1): row 1*16 + 1*1
    # a manifest the schema rejects is refused
    bad = dict(m, files=[dict(m["files"][0], sha256="xyz")])
    with pytest.raises(GkError, match="does not match schema"):
        mf.validate(bad)


def test_owned_rows_in_metadata_follow_the_hops(topo):
    _, out, _ = topo
    from gkbuild.layout.tail import owned_rows

    t = json.loads((out / "layout/tail.json").read_text())
    for rank in (0, 9, 100, 127):
        assert t["owned_rows"]["128"][str(rank)] == owned_rows(rank, 128, 128, (8, 16))


def test_check_passes_then_names_the_damage(topo, tmp_path):
    _, out, _ = topo
    assert run_cli("check", str(out), "-q").returncode == 0
    b = tmp_path / "b"
    shutil.copytree(out, b)
    p = b / "weights/expert-017.safetensors"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(bytes(raw))
    (b / "weights/tail-v003.safetensors").unlink()
    (b / "stray.bin").write_bytes(b"x")
    r = run_cli("check", str(b), "-q")
    assert r.returncode == 1
    assert "sha256 mismatch: weights/expert-017.safetensors" in r.stdout
    assert "missing: weights/tail-v003.safetensors" in r.stdout
    assert "extra: stray.bin is not in the manifest" in r.stdout
    assert len(r.stdout.strip().splitlines()) == 3
    assert r.stderr.strip() == f"gkbuild: error: {b}: 3 problem(s) against the manifest"


def test_noop_rebuild_runs_no_stage(topo):
    r, out, first = topo
    assert first.did_work
    again = compile_build(r, out=out, quiet=True, compile=False)
    assert not again.did_work and again.shards_written == 0
    assert {s.name: s.status for s in again.stages} == {
        "resolve": "cached", "validate": "cached", "plan": "cached", "shards": "cached", "layout": "cached",
        "compile": "skipped", "manifest": "cached"}
    assert again.manifest["build_id"] == first.manifest["build_id"]


def test_two_builds_are_byte_identical(topo, tmp_path):
    r, out, _ = topo
    other = tmp_path / "again"
    compile_build(r, out=other, quiet=True, jobs=1, compile=False)
    assert _tree(other) == _tree(out)


def test_a_tail_option_rebuilds_only_what_depends_on_it(topo, tmp_path):
    r, out, _ = topo
    b = tmp_path / "b"
    shutil.copytree(out, b)
    before = {p.name: p.stat().st_mtime_ns for p in (b / "weights").iterdir()}
    r2 = recipe.load(RECIPES / "tiny-topology-trn3.yaml", ["tail.k=128"])
    res = compile_build(r2, out=b, quiet=True, compile=False)
    st = {s.name: s.status for s in res.stages}
    assert st["shards"] == "cached" and st["layout"] == "ran" and st["manifest"] == "ran"
    assert {p.name: p.stat().st_mtime_ns for p in (b / "weights").iterdir()} == before
    # switching the experts to bf16 (for a kernel of one's own: the published one takes MX tiles)
    # rewrites the 128 expert shards and nothing else
    r3 = recipe.load(RECIPES / "tiny-topology-trn3.yaml", ["experts=bf16", f"compile.kernels.decode.library={LIB_A}"])
    res = compile_build(r3, out=b, quiet=True, compile=False)
    assert res.shards_written == 128
    after = {p.name: p.stat().st_mtime_ns for p in (b / "weights").iterdir()}
    assert all(after[n] != before[n] for n in after if n.startswith("expert-"))
    assert all(after[n] == before[n] for n in after if not n.startswith("expert-"))
    assert run_cli("check", str(b), "-q").returncode == 0


def test_a_smaller_topology_removes_the_stale_shards(topo, tmp_path):
    r, out, _ = topo
    b = tmp_path / "b"
    shutil.copytree(out, b)
    r2 = recipe.load(RECIPES / "tiny-topology-trn3.yaml", ["topology.dp=8", "topology.ep=64", "topology.vtp=64",
                                                           "topology.hops=[8, 8]", "decode.batch_sizes=[64]"])
    res = compile_build(r2, out=b, quiet=True, compile=False)
    assert res.shards_written == 64 + 64  # new expert and tail splits; tp unchanged: attn and shared kept
    names = {p.name for p in (b / "weights").iterdir()}
    assert "expert-100.safetensors" not in names and "tail-v100.safetensors" not in names
    assert "attn-tp7.safetensors" in names
    assert run_cli("check", str(b), "-q").returncode == 0


@pytest.mark.slow
def test_a_placement_change_rewrites_only_the_embedding_or_the_shared_file(topo, tmp_path):
    _, out, _ = topo
    b = tmp_path / "b"
    shutil.copytree(out, b)
    res = compile_build(recipe.load(RECIPES / "tiny-topology-trn3.yaml", ["decode.embedding=hidden"]), out=b,
                        quiet=True, compile=False)
    assert res.shards_written == 8  # embed-tp0..7
    assert not (b / "weights/embed-host.safetensors").exists()
    both = ["decode.embedding=hidden", "decode.rope=fused"]
    res = compile_build(recipe.load(RECIPES / "tiny-topology-trn3.yaml", both), out=b, quiet=True, compile=False)
    assert res.shards_written == 1  # shared.safetensors gains inv_freq
    assert run_cli("check", str(b), "-q").returncode == 0


def _wait_for_the_workers(out: Path, timeout: float = 60) -> None:
    """A killed build's workers die with it (PR_SET_PDEATHSIG), but one blocked in disk I/O exits
    only when that I/O completes, and holds the folder's lock until then (slow under load)."""
    import fcntl

    fd = os.open(out / ".gkbuild" / "lock", os.O_RDWR)
    try:
        deadline = time.time() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.time() < deadline, "the killed build's workers never exited"
                time.sleep(0.05)
    finally:
        os.close(fd)


def test_interrupted_build_resumes_to_the_same_bytes(topo, tmp_path):
    _, clean, _ = topo
    out = tmp_path / "killed"
    env = dict(os.environ, GKBUILD_SYNC_INTERVAL="0")
    cmd = [sys.executable, "-m", "gkbuild", "compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--out", str(out),
           "-q", "-j", "1", "--no-compile"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / ".gkbuild" / "state.json"
    deadline = time.time() + 120
    recorded = 0
    while time.time() < deadline and p.poll() is None:
        try:
            recorded = len(json.loads(state.read_text()).get("shards", {}))
        except (FileNotFoundError, json.JSONDecodeError):
            recorded = 0
        if recorded >= 20:
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    _wait_for_the_workers(out)
    assert 20 <= recorded < 266, "the kill must land midway"  # 266 shards: 1 + 8 + 128 + 128 + the embedding
    assert not (out / "manifest.json").exists()
    for f in (out / "weights").iterdir():  # a file under its final name is complete
        if not f.name.endswith(".partial"):
            read_header(f)
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml")
    res = compile_build(r, out=out, quiet=True, compile=False)
    assert 0 < res.shards_written <= 266 - 20  # finished shards were not redone
    assert _tree(out) == _tree(clean)


def test_bf16_experts_build(tmp_path):
    r = recipe.load(RECIPES / "tiny-cpu.yaml", ["experts=bf16"])
    out = tmp_path / "bf16"
    compile_build(r, out=out, quiet=True, compile=False)
    ck = Checkpoint.open(materialize(parse(r.source)))
    plan = make_plan(r, ck.config)
    f = next(f for f in plan.files if f.role == "expert")
    assert {t.name for t in f.tensors} == {"expert_gate_up_weights", "expert_gate_up_bias",
                                           "expert_down_weights", "expert_down_bias"}
    _assert_shard(out, f, _expected(r, ck, plan, f))


def test_bad_source_fails_cleanly(tiny_copy, tmp_path):
    (tiny_copy / "model-00002-of-00007.safetensors").write_bytes(b"\x00" * 10)
    rp = tmp_path / "r.yaml"
    rp.write_text(f"source: {tiny_copy}\ntarget: cpu\nkv_cache: {{num_blocks: 8, block_size: 4}}\n")
    out = tmp_path / "out"
    r = run_cli("compile", str(rp), "--out", str(out), "-q")
    assert r.returncode == 1
    assert r.stderr.startswith("gkbuild: error: ") and "model-00002-of-00007.safetensors" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (out / "manifest.json").exists() and not (out / "weights").exists()


def test_one_build_at_a_time(topo):
    import fcntl

    _, out, _ = topo
    fd = os.open(out / ".gkbuild" / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--out", str(out), "-q")
        assert r.returncode == 1 and "another gkbuild compile is writing" in r.stderr
    finally:
        os.close(fd)


def test_cli_json_summary_and_inspect(topo):
    _, out, _ = topo
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--out", str(out), "--json", "--no-compile")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["did_work"] is False and s["ranks"] == 128 and s["compile"].startswith("skipped")
    r = run_cli("inspect", str(out), "--json")
    i = json.loads(r.stdout)
    assert i["kind"] == "build" and i["ranks"] == 128 and i["by_role"]["expert"]["files"] == 128
    assert all(st["cached"] for st in i["stages"])
