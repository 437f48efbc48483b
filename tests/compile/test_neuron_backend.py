"""The neuron backend without the Neuron SDK: the per-rank signatures it compiles, what it would run,
and its whole flow through a fake SDK, a fake neuronx-cc and stand-ins written from the published
kernel sources (the real SDK installs only on Trainium hosts)."""

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gkbuild import recipe
from gkbuild.compile import kernel_source, neuron, signature
from gkbuild.errors import GkError
from gkbuild.model import preset
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.plan import make_plan
from tests.conftest import RECIPES, ROOT, run_cli

HERE = Path(__file__).resolve().parent
STANDINS, FAKE_SDK = HERE / "standins", HERE / "fake_sdk"
PER_BUFFER = STANDINS / "per_buffer"


def _plan(name="gpt-oss-120b-trn2", model="gpt-oss-120b", sets=()):
    return make_plan(recipe.load(RECIPES / f"{name}.yaml", list(sets)), preset(model))


def _topo(*sets):
    return _plan("tiny-topology-trn2", "tiny-topology", sets)


def _shapes(sig):
    return {i.name: (tuple(i.shape), i.dtype, i.kind) for i in sig.inputs}


def test_per_rank_signatures_of_tiny_topology():
    """TP8 x DP16 x EP128 at batch 128: each rank holds 1 token, a DP replica attends over 8."""
    p = _topo()
    dec = signature.neuron_decode(p, 128)
    s = _shapes(dec)
    d = p.dims
    assert s["x_shard"] == ((1, d.Hp), "bfloat16", "activation")
    assert s["active_blocks_table"] == ((8, 16), "int32", "control")
    assert s["active_blocks_table_swa"][:2] == ((8, p.scalars["swa_table_blocks"]), "int32")
    assert s["kv_cache_update_idx"] == ((8, 1), "uint32", "control") and "kv_cache_update_idx_swa" not in s
    assert s["cos"] == ((16, 8, 1), "float32", "control") and s["sin"][0] == (16, 8, 1)
    assert s["pos_ids"] == ((8, 1), "float32", "control") and s["pos_ids_swa"][0] == (8, 1)
    assert s["swa_start_pos_ids"][0] == (2, 8, 1) and s["attention_mask"] == ((1, 8, 8, 1), "uint8", "control")
    assert s["rank_id"] == ((1, 1), "uint32", "rank")
    # packed FP8 K, stacked: one K and one V tensor with a layer a entry, trn2's non-OCP e4m3
    assert s["K_cache"] == ((2, 80, 1, 2, 32, 2), "float8_e4m3", "kv_buffer")
    assert s["V_cache"] == ((2, 80, 1, 4, 32), "float8_e4m3", "kv_buffer")
    assert s["k_scale"] == ((1, 1), "float32", "constant") and dec.input("k_scale").value == 1.0
    assert [o["name"] for o in dec.outputs] == ["x_shard", "K_cache", "V_cache"]
    assert dec.outputs[1]["aliases"] == "K_cache"
    assert dec.scalars["B_attn"] == 8 and dec.scalars["S_tkg"] == 1 and dec.scalars["num_layers"] == 2
    # the public kernel's parameter order: x_shard, the attention weights, K/V, the MoE weights, control
    names = dec.names()
    assert names[:9] == ["x_shard", "input_layernorm_weight", "W_qkv", "bias_qkv", "W_out", "bias_out", "sink",
                         "K_cache", "V_cache"]
    assert names.index("expert_down_bias") < names.index("swa_start_pos_ids") < names.index("rank_id")
    tl = signature.neuron_tail(p, 128)
    t = _shapes(tl)
    assert t["hidden_states"] == ((128, d.Hp), "bfloat16", "activation")
    assert t["sampling_params"] == ((1, 3), "float32", "control")
    assert t["lm_head_weight_t"][:2] == ((d.Hp, 16), "bfloat16") and t["gamma"][:2] == ((1, d.Hp), "float32")
    assert [o["name"] for o in tl.outputs] == ["logits", "topk_values", "topk_indices", "tokens"]
    assert tl.outputs[-1] == {"name": "tokens", "shape": [1, 1], "dtype": "uint32"}
    assert _shapes(signature.neuron_tail(_topo("tail.runtime_draw=true"), 128))["sampling_params"][0] == (1, 4)
    # trn3 takes OCP e4m3fn; bf16 KV has no scales
    assert _shapes(signature.neuron_decode(_topo("target=trn3"), 128))["K_cache"][1] == "float8_e4m3fn"
    bf = _shapes(signature.neuron_decode(_topo("kv_cache.dtype=bf16", "kv_cache.packed=false"), 128))
    assert bf["K_cache"] == ((2, 80, 1, 4, 32), "bfloat16", "kv_buffer") and "k_scale" not in bf


def test_per_buffer_signature():
    s = _shapes(signature.neuron_decode(_topo("kv_cache.form=per_buffer"), 128))
    assert s["K_cache_buf_0"] == ((80, 1, 2, 32, 2), "float8_e4m3", "kv_buffer") and "K_cache" not in s
    assert s["V_cache_buf_0"][0] == (80, 1, 4, 32) and "K_cache_buf_1" not in s  # 2 layers: one buffer
    assert s["kv_cache_update_idx_swa"] == ((8, 1), "uint32", "control")
    big = _shapes(signature.neuron_decode(_plan(sets=["kv_cache.form=per_buffer"]), 128))
    assert sum(n.startswith("K_cache_buf_") for n in big) == 18 and big["K_cache_buf_17"][0] == (14563, 1, 64, 64, 2)


def test_120b_signature_and_scalars():
    p = _plan()
    dec = signature.neuron_decode(p, 128)
    s = _shapes(dec)
    assert s["x_shard"][0] == (1, 3072) and s["active_blocks_table"][0] == (8, 80)
    assert s["K_cache"][0] == (36, 14563, 1, 64, 64, 2) and s["cos"][0] == (32, 8, 1)
    a = dec.scalars
    assert a["tp_replica_group"][15] == tuple(range(120, 128)) and a["ep_replica_group"] == (tuple(range(128)),)
    assert (a["num_layers"], a["tp_size"], a["ep_size"], a["B_attn"], a["S_tkg"], a["top_k"]) == (36, 8, 128, 8, 1, 4)
    assert a["hidden_actual"] == 2880 and a["up_clamp_upper_limit"] == 8.0 and a["up_clamp_lower_limit"] == -6.0
    t = signature.neuron_tail(p, 128).scalars
    assert t["k"] == 256 and t["zero_interleaved_pad"] and len(t["hop_meshes"]) == 2 and not t["emit_logits"]
    assert {i.file for i in dec.inputs if i.kind == "weight"} == {"weights/shared.safetensors",
                                                                 "weights/attn-tp0.safetensors",
                                                                 "weights/expert-000.safetensors"}


def test_invocation_and_flags():
    p = _plan()
    sig = signature.neuron_decode(p, 128)
    cmd = neuron.invocation(sig, p.recipe, p.recipe.output_dir())
    assert cmd[:3] == ["neuronx-cc", "compile", "--framework=XLA"]
    assert cmd[3].endswith(".gkbuild/neuron/decode-b128.hlo.pb") and cmd[4] == "--output"
    assert cmd[5].endswith("compiled/decode-b128.neff")
    for flag in ("--target=trn2", "--lnc=1", "--model-type=transformer", "--auto-cast=none", "-O2"):
        assert flag in cmd
    p3 = _plan("gpt-oss-120b-trn3")
    assert "--target=trn3" in neuron.invocation(signature.neuron_tail(p3, 128), p3.recipe, Path("x"))


def test_trace_environment_holds_exactly_the_recipes_switches():
    r = recipe.load(RECIPES / "tiny-topology-trn2.yaml")
    env = neuron.trace_environment(r, {"PATH": "/bin", "VLLM_NEURON_MEGA_SBUF_INTERLAYER": "1",
                                       "VLLM_NEURON_MEGA_KV_UPDATE": ""})
    assert env["VLLM_NEURON_MEGA_KV_UPDATE"] == "1" and "VLLM_NEURON_MEGA_SBUF_INTERLAYER" not in env
    assert env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn2" and env["PJRT_DEVICE"] == "CPU"
    dev = recipe.load(RECIPES / "tiny-topology-trn2.yaml", ["compile.trace=device"])
    assert "NEURON_PLATFORM_TARGET_OVERRIDE" not in neuron.trace_environment(dev, {"PATH": "/bin"})


def test_show_compile_prints_every_program_of_every_batch_size():
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn2.yaml"), "--show-compile", "--set",
                "decode.batch_sizes=[128, 256]")
    lines = [line for line in r.stdout.splitlines() if line.startswith("neuronx-cc compile")]
    assert r.returncode == 0 and len(lines) == 4, r.stderr
    assert ["decode-b128.neff" in lines[0], "tail-b128.neff" in lines[1], "decode-b256.neff" in lines[2]] == [True] * 3
    assert "--lnc=1" in lines[0] and shlex.split(lines[0])[0] == "neuronx-cc"
    r = run_cli("plan", str(RECIPES / "tiny-cpu.yaml"), "--show-compile", "--json")
    assert "aoti_compile_and_package" in json.loads(r.stdout)["compile"][0]


def test_without_the_sdk_a_trn_build_is_complete_but_for_the_neffs(tmp_path):
    assert neuron.sdk() is not None  # the Neuron SDK cannot be installed on these machines
    out = tmp_path / "b"
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn2.yaml"), "--out", str(out), "-q", "--set",
                "decode.batch_sizes=[128, 256]")
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and "Neuron SDK not installed" in r.stderr  # said out loud, even with -q
    m = mf.load(out)  # validates against the schema
    c = m["compile"]
    assert c["status"].startswith("skipped: Neuron SDK not installed") and c["backend"] == "neuron"
    assert [(a["name"], a["program"], a["batch_size"]) for a in c["artifacts"]] == [
        ("decode-b128", "decode", 128), ("tail-b128", "tail", 128), ("decode-b256", "decode", 256),
        ("tail-b256", "tail", 256)]
    for a in c["artifacts"]:
        assert a["format"] == "neff" and a["path"] is None and a["status"].startswith("skipped")
        assert "--lnc=1" in a["flags"] and a["compiler"]["name"] == "neuronx-cc"
        assert a["kernel"]["switches"] == {"VLLM_NEURON_MEGA_KV_UPDATE": "1"} and a["kernel"]["trace"] == "host"
        assert a["kernel"]["revision"] == "e9ef98fc47b3323bf0de8ebcc984b8e2f3adff07"
    d256 = {i["name"]: i for i in c["artifacts"][2]["inputs"]}
    assert d256["x_shard"]["shape"] == [2, 512] and d256["kv_cache_update_idx"]["shape"] == [16, 1]
    assert run_cli("check", str(out), "-q").returncode == 0


def test_require_neff_fails(tmp_path):
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn2.yaml"), "--out", str(tmp_path / "b"), "-q",
                "--require-neff")
    assert r.returncode == 1
    assert r.stderr.strip().startswith("gkbuild: error: --require-neff: Neuron SDK not installed")
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_kernel_source_forms(tmp_path):
    src = kernel_source.parse("aws-neuron/nki-library@" + "a" * 40)
    assert (src.kind, src.url, src.commit) == ("git", "https://github.com/aws-neuron/nki-library.git", "a" * 40)
    assert kernel_source.parse("git+https://example.com/x.git@" + "b" * 40).url == "https://example.com/x.git"
    assert kernel_source.parse("lib", base=tmp_path).path == tmp_path / "lib"
    for bad, msg in (("aws-neuron/nki-library@main", "full 40-hex commit"),
                     ("https://example.com/x.git", "neither an existing folder"),
                     ("owner/missing-folder", "neither an existing folder")):
        with pytest.raises(GkError, match=msg):
            kernel_source.parse(bad, base=tmp_path)
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "pkg" / "k.py").write_text("x = 1\n")
    before = kernel_source.revision(kernel_source.parse(str(lib)))
    (lib / "pkg" / "k.py").write_text("x = 2\n")
    assert kernel_source.revision(kernel_source.parse(str(lib))) != before  # a changed kernel recompiles


def test_git_kernel_source_is_cloned_at_its_commit(tmp_path):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "mod.py").write_text("v = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    first = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "src" / "mod.py").write_text("v = 2\n")
    subprocess.run(git + ["commit", "-qam", "two"], check=True)
    src = kernel_source.parse(f"file://{repo}@{first}")
    root = kernel_source.checkout(src, tmp_path / "cache")
    assert (root / "src" / "mod.py").read_text() == "v = 1\n"  # the pinned commit, not the branch head
    assert kernel_source.import_roots(root) == [str(root / "src")]
    assert kernel_source.checkout(src, tmp_path / "cache") == root  # once
    with pytest.raises(GkError, match="git checkout failed"):
        kernel_source.checkout(kernel_source.parse(f"file://{repo}@{'c' * 40}"), tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "kernels").iterdir() if p.name.endswith(".partial")]


# -- the whole flow through the fake SDK and the stand-ins ------------------------------------------
FAKE_CC = '''#!{python}
"""A stand-in neuronx-cc: records its argv, writes a NEFF of the documented layout."""
import json, sys
sys.path.insert(0, {root!r})
from tests.compile.neff_files import make
argv = sys.argv[1:]
out = argv[argv.index("--output") + 1]
open(out, "wb").write(make(name=out.rsplit("/", 1)[-1], lnc=1))
with open({log!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
'''


@pytest.fixture
def fake_sdk(tmp_path, monkeypatch):
    """The fake SDK importable here and in the trace process, and a fake neuronx-cc on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    logs = {"cc": tmp_path / "cc_argv.jsonl", "sdk": tmp_path / "sdk.log"}
    cc = bindir / "neuronx-cc"
    cc.write_text(FAKE_CC.format(python=sys.executable, root=str(ROOT), log=str(logs["cc"])))
    cc.chmod(0o755)
    monkeypatch.syspath_prepend(str(FAKE_SDK))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SDK), str(STANDINS)]))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("GK_FAKE_SDK_LOG", str(logs["sdk"]))
    monkeypatch.setenv("VLLM_NEURON_MEGA_SBUF_INTERLAYER", "1")  # a stray switch the build must not pass on
    assert neuron.sdk() is None
    return logs


def _build(out, library, *sets):
    r = recipe.load(RECIPES / "tiny-topology-trn2.yaml", [f"compile.nki_library={library}", *sets])
    return compile_build(r, out=out, quiet=True, require_neff=True)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_conformance_with_the_published_kernels_in_both_kv_forms(fake_sdk, tmp_path, target):
    out = tmp_path / "b"
    for form, library in (("stacked", STANDINS), ("per_buffer", PER_BUFFER)):
        res = _build(out, library, f"target={target}", f"kv_cache.form={form}")
        c = res.manifest["compile"]
        assert c["status"] == "ok" and [a["name"] for a in c["artifacts"]] == ["decode-b128", "tail-b128"]
        for a in c["artifacts"]:
            assert a["path"] == f"compiled/{a['name']}.neff" and a["neff"]["lnc_size"] == 1
            assert (out / a["path"]).stat().st_size == a["size"]
        # what each traced kernel returned (the fake HLO lists the outputs): the decode step hands
        # back x and the K/V it wrote (KV write-back was on while tracing); the tail, its 4 outputs
        dec = json.loads((out / ".gkbuild/neuron/decode-b128.hlo.pb").read_text())
        assert dec[0] == [[1, 512], "torch.bfloat16"] and len(dec) == 3
        want_kv = "torch.float8_e4m3fn"  # trn2's e4m3 is carried by the fake SDK's alias (see its README)
        assert dec[1][1] == want_kv and dec[1][0] == ([2, 80, 1, 2, 32, 2] if form == "stacked" else [80, 1, 2, 32, 2])
        tl = json.loads((out / ".gkbuild/neuron/tail-b128.hlo.pb").read_text())
        assert tl == [[[128, 16], "torch.float32"], [[1, 256], "torch.bfloat16"], [[1, 256], "torch.uint32"],
                      [[1, 1], "torch.uint32"]]
        assert run_cli("check", str(out), "-q").returncode == 0
    # every trace ran in the host compile mode, with exactly the recipe's switches
    lines = fake_sdk["sdk"].read_text().splitlines()
    assert len(lines) == 4 and set(lines) == {f"device target={target} pjrt=CPU kv_update=1"}
    argv = [json.loads(line) for line in fake_sdk["cc"].read_text().splitlines()]
    assert [a[:2] for a in argv] == [["compile", "--framework=XLA"]] * 4 and f"--target={target}" in argv[0]


_DECODE = signature.neuron_decode


def _refusal(tmp_path, monkeypatch, library, change, *sets):
    """Compile with one input of the decode signature changed; the one-line error."""

    def changed(plan, batch):
        s = _DECODE(plan, batch)
        return signature.Signature(s.program, tuple(change(list(s.inputs))), s.outputs, s.batch, s.scalars)

    monkeypatch.setattr(signature, "neuron_decode", changed)
    with pytest.raises(GkError) as e:
        _build(tmp_path / "b", library, *sets)
    assert "\n" not in str(e.value)
    return str(e.value)


def _replace(name, **kw):
    def change(inputs):
        return [signature.Input(**{**i.__dict__, **kw}) if i.name == name else i for i in inputs]
    return change


@pytest.mark.slow
def test_every_kind_of_mismatch_is_refused_in_one_line(fake_sdk, tmp_path, monkeypatch):
    msg = _refusal(tmp_path, monkeypatch, STANDINS, _replace("cos", shape=(16, 128, 1)))
    assert msg.startswith("decode-b128: the decode kernel refused its arguments") and "cos shape mismatch" in msg
    msg = _refusal(tmp_path, monkeypatch, STANDINS, lambda ins: [i for i in ins if i.name != "rank_id"])
    assert "signature does not match" in msg and "missing ['rank_id']" in msg
    msg = _refusal(tmp_path, monkeypatch, STANDINS, _replace("kv_cache_update_idx", dtype="int64"))
    assert "kv_cache_update_idx must be uint32" in msg
    msg = _refusal(tmp_path, monkeypatch, STANDINS, lambda ins: ins + [signature.Input("K_cache_buf_0", (1,), "uint8",
                                                                                        "kv_buffer")])
    assert "does not take ['K_cache_buf_0']" in msg  # the public kernel has no per-buffer form
    both = lambda ins: ins + [signature.Input("K_cache", (2, 80, 1, 2, 32, 2), "float8_e4m3", "kv_buffer")]  # noqa: E731
    msg = _refusal(tmp_path, monkeypatch, PER_BUFFER, both, "kv_cache.form=per_buffer")
    assert "exactly one KV form" in msg


def test_verify_on_neuron_says_in_one_line_what_it_needs(tmp_path, monkeypatch):
    """No SDK here: one line, non-zero. With an SDK but a build without NEFFs, or a tail that emits
    no logits: one line each. The launch line is one process a rank."""
    from gkbuild.compile import neuron_run

    out = tmp_path / "b"
    assert run_cli("compile", str(RECIPES / "tiny-topology-trn2.yaml"), "--out", str(out), "-q").returncode == 0
    r = run_cli("verify", str(out), "--engine", "neuron")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("gkbuild: error: --engine neuron: Neuron SDK not installed")
    monkeypatch.syspath_prepend(str(FAKE_SDK))
    m = mf.load(out)
    with pytest.raises(GkError, match="has no Neuron programs"):
        neuron_run.check(m)
    m["compile"]["status"] = "ok"
    with pytest.raises(GkError, match="does not emit logits"):
        neuron_run.check({**m, "compile": {**m["compile"], "artifacts": [
            {**a, "scalars": {**a["scalars"], "emit_logits": False}} for a in m["compile"]["artifacts"]]}})
    assert len(neuron_run.check(m)) == 2
    cmd = neuron_run.command(out, tmp_path / "g.safetensors", tmp_path / "o", 128, 128)
    assert cmd[:4] == ["torchrun", "--standalone", "--nproc-per-node=128", "-m"] and cmd[4] == "gkbuild.compile.neuron_run"


def test_fused_embedding_and_rope_change_the_decode_signature_as_the_contract_describes():
    """vocab-sharded embedding: embed_weight [V/W, Hp] + embed_ids [B] replace x_shard; hidden:
    [V, Hp/TP] + ids [B/DP]; fused RoPE: inv_freq [d/2, 1] and rope_concentration replace cos/sin.
    The public kernel takes none of them, so its argument check refuses such a build."""
    s = _shapes(signature.neuron_decode(_topo("decode.embedding=vocab", "decode.rope=fused"), 128))
    assert "x_shard" not in s and "cos" not in s and "sin" not in s
    assert s["embed_weight"][:2] == ((16, 512), "bfloat16") and s["embed_ids"] == ((128,), "int32", "control")
    assert s["inv_freq"][:3] == ((16, 1), "float32", "weight")
    dec = signature.neuron_decode(_topo("decode.rope=fused"), 128)
    assert dec.scalars["rope_concentration"] == pytest.approx(0.1 * math.log(32) + 1)
    h = _shapes(signature.neuron_decode(_topo("decode.embedding=hidden"), 128))
    assert h["embed_weight"][0] == (2048, 64) and h["embed_ids"][0] == (8,) and "cos" in h
