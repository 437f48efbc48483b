"""The neuron backend without the Neuron SDK: the per-rank signatures it compiles, what it would run,
and its whole flow through a fake SDK, a fake neuronx-cc and stand-ins written from the published
kernel sources (the real SDK installs only on Trainium hosts)."""

import json
import math
import shlex
import subprocess
from pathlib import Path

import pytest

from gkbuild import recipe
from gkbuild.compile import kernel_source, neuron, signature
from gkbuild.errors import GkError
from gkbuild.model import preset
from gkbuild.pipeline import manifest as mf
from gkbuild.plan import make_plan
from tests.compile.conftest import FAKE_SDK
from tests.conftest import RECIPES, run_cli



def _plan(name="gpt-oss-120b-trn3", model="gpt-oss-120b", sets=(), target="trn2"):
    """A shipped recipe's plan, for trn2 unless told: its FP8 route and flags are much of what is checked
    here (no recipe ships for trn2, where no published decode runs; the plan and layout still hold)."""
    return make_plan(recipe.load(RECIPES / f"{name}.yaml", [f"target={target}", *sets]), preset(model))


def _topo(*sets):
    return _plan("tiny-topology-trn3", "tiny-topology", sets)


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
    # packed FP8 K, stacked: one K and one V tensor with a layer an entry; trn2's e4m3 travels as
    # float8_e4m3fn (torch has no IEEE e4m3; NCC_EVRF051's route)
    assert s["K_cache"] == ((2, 96, 1, 2, 32, 2), "float8_e4m3fn", "kv_buffer")
    assert s["V_cache"] == ((2, 96, 1, 4, 32), "float8_e4m3fn", "kv_buffer")
    assert s["k_scale"] == ((1, 1), "float32", "constant") and dec.input("k_scale").value == 1.0
    assert [o["name"] for o in dec.outputs] == ["x_shard", "K_cache", "V_cache"]
    assert dec.outputs[1]["aliases"] == "K_cache"
    assert dec.scalars["B_attn"] == 8 and dec.scalars["S_tkg"] == 1 and dec.scalars["num_layers"] == 2
    # the kernel's parameter order: x_shard, the attention weights, K/V, the MoE weights, control
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
    assert _shapes(signature.neuron_decode(_topo("target=trn3"), 128))["K_cache"][1] == "float8_e4m3fn"
    bf = _shapes(signature.neuron_decode(_topo("kv_cache.dtype=bf16", "kv_cache.packed=false"), 128))
    assert bf["K_cache"] == ((2, 96, 1, 4, 32), "bfloat16", "kv_buffer") and "k_scale" not in bf


def test_paired_signature():
    """F's layer-pair form: ceil(L/2) entries of the same tensors, and the sliding layers' own update index."""
    s = _shapes(signature.neuron_decode(_topo("kv_cache.form=paired"), 128))
    assert s["K_cache"] == ((1, 96, 1, 2, 32, 2), "float8_e4m3fn", "kv_buffer") and "K_cache_buf_0" not in s
    assert s["V_cache"][0] == (1, 96, 1, 4, 32)
    assert s["kv_cache_update_idx_swa"] == ((8, 1), "uint32", "control")
    big = _shapes(signature.neuron_decode(_plan(sets=["kv_cache.form=paired"]), 128))
    assert big["K_cache"][0] == (18, 14563, 1, 64, 64, 2) and not any(n.startswith("K_cache_buf") for n in big)


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
    assert t["k"] == 256 and t["zero_interleaved_pad"] and not t["emit_logits"]
    # the tail's hop meshes are compose_hops' tuples of rank tuples (the kernel reads len(mesh[0]))
    assert len(t["hop_meshes"]) == 2 and t["hop_meshes"][0][0] == tuple(range(8))
    assert t["hop_meshes"][1][0] == tuple(range(0, 128, 8))
    assert {i.file for i in dec.inputs if i.kind == "weight"} == {"weights/shared.safetensors",
                                                                 "weights/attn-tp0.safetensors",
                                                                 "weights/expert-000.safetensors"}


def test_invocation_and_flags():
    """The documented host path by default (torch_neuronx.trace, cpu_backend, the target override);
    the neuronx-cc CLI only for the explicit xla-cpu mode; trn2's FP8 flag on its FP8 decode only."""
    p = _plan()
    sig = signature.neuron_decode(p, 128)
    cmd = neuron.invocation(sig, p.recipe, p.recipe.output_dir())
    assert cmd[:3] == ["NEURON_PLATFORM_TARGET_OVERRIDE=trn2", "torch_neuronx.trace", "--cpu-backend=True"]
    assert "--output=" + str(p.recipe.output_dir() / "compiled/decode-b128.neff") in cmd
    for flag in ("--target=trn2", "--lnc=1", "--model-type=transformer", "--auto-cast=none", "-O2",
                 "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"):
        assert flag in cmd
    assert "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3" not in neuron.flags(p.recipe, "tail")
    p3 = _plan("gpt-oss-120b-trn3", target="trn3")
    t3 = neuron.invocation(signature.neuron_tail(p3, 128), p3.recipe, Path("x"))
    assert "--target=trn3" in t3 and "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3" not in neuron.flags(p3.recipe)
    assert "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3" not in neuron.flags(_topo("kv_cache.dtype=bf16",
                                                                                  "kv_cache.packed=false").recipe)
    xla = _plan(sets=["compile.trace=xla-cpu"])
    cmd = neuron.invocation(signature.neuron_decode(xla, 128), xla.recipe, Path("b"))
    assert cmd[:3] == ["neuronx-cc", "compile", "--framework=XLA"] and cmd[3].endswith("decode-b128.hlo.pb")
    assert cmd[cmd.index("--output") + 1] == "b/compiled/decode-b128.neff"
    dev = _plan(sets=["compile.trace=device"])
    assert neuron.invocation(sig, dev.recipe, Path("b"))[:2] == ["torch_neuronx.trace", "--cpu-backend=False"]


def test_trace_environment_sets_every_switch_the_revision_reads():
    """The caller's strays are dropped; every switch of the revision is set; the compile mode's
    variables are set and nothing else of the SDK's."""
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml")
    rec = neuron.kernel(r, "decode")
    assert rec["library"] == kernel_source.A and rec["interface"]["file"].startswith("aws-neuron+nki-library@e9ef98fc")
    stray = {"PATH": "/bin", "VLLM_NEURON_MEGA_SBUF_INTERLAYER": "1", "VLLM_NEURON_MEGA_BOGUS": "1", "PJRT_DEVICE": "CPU"}
    env = neuron.trace_environment(rec, "trn2", stray)
    assert env["VLLM_NEURON_MEGA_KV_UPDATE"] == "1" and env["VLLM_NEURON_MEGA_SBUF_INTERLAYER"] == ""
    assert "VLLM_NEURON_MEGA_BOGUS" not in env and "PJRT_DEVICE" not in env
    assert env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn2"
    assert {k for k in env if k.startswith("VLLM_NEURON_MEGA_")} == set(rec["switches"])
    dev = neuron.trace_environment({**rec, "trace": "device"}, "trn2", {"PATH": "/bin"})
    assert "NEURON_PLATFORM_TARGET_OVERRIDE" not in dev
    xla = neuron.trace_environment({**rec, "trace": "xla-cpu"}, "trn3", {"PATH": "/bin"})
    assert xla["PJRT_DEVICE"] == "CPU" and xla["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn3"
    f = neuron.kernel(recipe.load(RECIPES / "tiny-topology-trn3.yaml", ["kv_cache.form=paired"]), "decode")
    assert f["library"] == kernel_source.F  # a form only F has makes F the decode's default
    env = neuron.trace_environment(f, "trn2", {})
    assert env["VLLM_NEURON_MEGA_FP8_RS"] == "0" and env["VLLM_NEURON_MEGA_KV_UPDATE"] == "1"  # F reads absent as ON
    # the library's other environment reads (found by the scan) and the caller's compiler flags stay unset
    env = neuron.trace_environment({**f, "unset": ["NKI_X"]}, "trn3", {"NKI_X": "1", "NEURON_CC_FLAGS": "-O3"})
    assert "NKI_X" not in env and "NEURON_CC_FLAGS" not in env
    # a switch F reads outside the files of its committed interface is kept at plan time, judged by the scan
    gu = neuron.kernel(recipe.load(RECIPES / "tiny-topology-trn3.yaml", ["kv_cache.form=paired",
                                   "compile.kernel_switches=[VLLM_NEURON_MEGA_GU_P0=1]"]), "decode")
    assert gu["switches"]["VLLM_NEURON_MEGA_GU_P0"]["origin"] == "recipe" and gu["switch_overrides"] == {
        "VLLM_NEURON_MEGA_GU_P0": "1"}


def test_show_compile_prints_every_program_of_every_batch_size():
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn3.yaml"), "--show-compile", "--set",
                "decode.batch_sizes=[128, 256]")
    lines = [line for line in r.stdout.splitlines() if "torch_neuronx.trace" in line]
    assert r.returncode == 0 and len(lines) == 4, r.stderr
    assert ["decode-b128.neff" in lines[0], "tail-b128.neff" in lines[1], "decode-b256.neff" in lines[2]] == [True] * 3
    assert "--lnc=1" in lines[0] and shlex.split(lines[0])[0] == "NEURON_PLATFORM_TARGET_OVERRIDE=trn3"
    r = run_cli("plan", str(RECIPES / "tiny-cpu.yaml"), "--show-compile", "--json")
    assert "aoti_compile_and_package" in json.loads(r.stdout)["compile"][0]


def test_without_the_sdk_a_trn_build_is_complete_but_for_the_neffs(tmp_path):
    assert neuron.sdk() is not None  # the Neuron SDK cannot be installed on these machines
    out = tmp_path / "b"
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--out", str(out), "-q", "--set",
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
        k = a["kernel"]
        assert k["trace"] == "host" and k["switches"]["VLLM_NEURON_MEGA_KV_UPDATE"]["value"] == "1"
        # each program its own library@commit, from the committed interface of that revision
        want = kernel_source.A if a["program"] == "decode" else kernel_source.F
        assert k["library"] == want and k["revision"] == want.rpartition("@")[2]
        assert k["entry"] == kernel_source.ENTRIES[a["program"]] and k["interface"]["file"].endswith(".json")
    # trn3 takes e4m3fn as is: no trn2 conversion flag (trn2's is test_invocation_and_flags')
    assert all("--experimental-unsafe-fp8e4m3fn-as-fp8e4m3" not in a["flags"] for a in c["artifacts"])
    d256 = {i["name"]: i for i in c["artifacts"][2]["inputs"]}
    assert d256["x_shard"]["shape"] == [2, 512] and d256["kv_cache_update_idx"]["shape"] == [16, 1]
    assert run_cli("check", str(out), "-q").returncode == 0
    r = run_cli("inspect", str(out), "--json")
    progs = {p["name"]: p for p in json.loads(r.stdout)["programs"]}
    assert progs["decode-b128"]["library"] == "https://github.com/aws-neuron/nki-library.git@" + \
        kernel_source.A.rpartition("@")[2]
    assert progs["tail-b256"]["entry"].endswith(":gpt_oss_tail_chunked_megakernel")
    assert (progs["decode-b256"]["batch_size"], progs["decode-b256"]["lnc"]) == (256, 1)
    assert progs["decode-b128"]["inputs"] == len(c["artifacts"][0]["inputs"]) and progs["tail-b128"]["outputs"] == 4
    assert progs["decode-b128"]["switches"]["VLLM_NEURON_MEGA_KV_UPDATE"] == "1"
    assert "programs" in run_cli("inspect", str(out)).stdout


def test_require_neff_fails(tmp_path):
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--out", str(tmp_path / "b"), "-q",
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


def test_verify_on_neuron_says_in_one_line_what_it_needs(tmp_path, monkeypatch):
    """No SDK here: one line, non-zero. With an SDK but a build without NEFFs, or a tail that emits
    no logits: one line each. The launch line is one process a rank."""
    from gkbuild.compile import neuron_run

    out = tmp_path / "b"
    assert run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--out", str(out), "-q").returncode == 0
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
    """vocab-sharded embedding: embed_weight [ceil(V/TP), Hp] + embed_ids [B_attn] beside x_shard;
    hidden: [V, Hp/TP] + ids [B_attn] + embed_x_shard_ids [T_shard]; fused RoPE: inv_freq [d/2, 1] and
    rope_concentration beside cos/sin (CONTRACT.md section 6, the fork F's prologues)."""
    s = _shapes(signature.neuron_decode(_topo("decode.embedding=vocab", "decode.rope=fused"), 128))
    assert s["x_shard"][0] == (1, 512) and s["cos"][0] == (16, 8, 1) and "sin" in s
    assert s["embed_weight"][:2] == ((256, 512), "bfloat16") and s["embed_ids"] == ((8,), "int32", "control")
    assert s["inv_freq"][:3] == ((16, 1), "float32", "weight") and "embed_x_shard_ids" not in s
    dec = signature.neuron_decode(_topo("decode.rope=fused"), 128)
    assert dec.scalars["rope_concentration"] == pytest.approx(0.1 * math.log(32) + 1)
    h = _shapes(signature.neuron_decode(_topo("decode.embedding=hidden"), 128))
    assert h["embed_weight"][0] == (2048, 64) and h["embed_ids"][0] == (8,) and "cos" in h
    assert h["embed_x_shard_ids"] == ((1,), "int32", "rank")
    h256 = _shapes(signature.neuron_decode(_topo("decode.embedding=hidden", "decode.batch_sizes=[256]"), 256))
    assert h256["embed_ids"][0] == (16,) and h256["embed_x_shard_ids"][0] == (2,)
