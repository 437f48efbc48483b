"""The neuron backend without the Neuron SDK: what it would run, and its whole flow through a fake
SDK and a fake neuronx-cc (the real ones install only on Trainium hosts)."""

import json
import os
import shlex
import sys
import textwrap

import pytest

from gkbuild import recipe
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.compile import neuron, signature
from gkbuild.errors import GkError
from gkbuild.model import preset
from gkbuild.plan import make_plan
from tests.conftest import RECIPES, run_cli


def _plan(name="gpt-oss-120b-trn2", model="gpt-oss-120b"):
    return make_plan(recipe.load(RECIPES / f"{name}.yaml"), preset(model))


def test_invocation_and_flags():
    p = _plan()
    cmd = neuron.invocation("decode", p.recipe, p.recipe.output_dir())
    assert cmd[:3] == ["neuronx-cc", "compile", "--framework=XLA"]
    assert cmd[3].endswith(".gkbuild/neuron/decode.hlo.pb") and cmd[4] == "--output"
    assert cmd[5].endswith("compiled/decode.neff")
    for flag in ("--target=trn2", "--lnc=1", "--model-type=transformer", "--auto-cast=none", "-O2"):
        assert flag in cmd
    assert "--target=trn3" in neuron.invocation("tail", _plan("gpt-oss-120b-trn3").recipe, p.recipe.output_dir())


def test_kernel_arguments_for_the_120b_plan():
    p = _plan()
    a = neuron.kernel_arguments(p, "decode")
    assert a["tp_replica_group"][15] == tuple(range(120, 128)) and a["ep_replica_group"] == (tuple(range(128)),)
    assert (a["num_layers"], a["tp_size"], a["ep_size"], a["B_attn"], a["S_tkg"], a["top_k"]) == (36, 8, 128, 8, 1, 4)
    assert a["hidden_actual"] == 2880 and a["up_clamp_upper_limit"] == 8.0 and a["up_clamp_lower_limit"] == -6.0
    t = neuron.kernel_arguments(p, "tail")
    assert t["k"] == 256 and t["zero_interleaved_pad"] and len(t["hop_meshes"]) == 2
    names = neuron.tensor_names(signature.decode(p))
    assert names["x"] == "x_shard" and names["block_table_swa"] == "active_blocks_table_swa"
    assert names["K_cache_17"] == "K_cache_buf_17" and names["W_qkv"] == "W_qkv"
    sig = signature.decode(p)
    assert [i.shape for i in sig.inputs if i.name == "K_cache_0"] == [(36175, 1, 64, 64, 2)]
    assert {i.file for i in sig.inputs if i.kind == "weight"} == {"weights/shared.safetensors",
                                                                 "weights/attn-tp0.safetensors",
                                                                 "weights/expert-000.safetensors"}


def test_show_compile():
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn2.yaml"), "--show-compile")
    lines = [line for line in r.stdout.splitlines() if line.startswith("neuronx-cc compile")]
    assert r.returncode == 0 and len(lines) == 2
    assert "--lnc=1" in lines[0] and "decode.neff" in lines[0] and "tail.neff" in lines[1]
    assert shlex.split(lines[0])[0] == "neuronx-cc"
    r = run_cli("plan", str(RECIPES / "tiny-cpu.yaml"), "--show-compile", "--json")
    assert "aoti_compile_and_package" in json.loads(r.stdout)["compile"][0]


def test_without_the_sdk_a_trn_build_is_complete_but_for_the_neffs(tmp_path):
    assert neuron.sdk() is not None  # the Neuron SDK cannot be installed on these machines
    out = tmp_path / "b"
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn2.yaml"), "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and "Neuron SDK not installed" in r.stderr  # said out loud, even with -q
    m = mf.load(out)  # validates against the schema
    c = m["compile"]
    assert c["status"].startswith("skipped: Neuron SDK not installed") and c["backend"] == "neuron"
    assert [a["name"] for a in c["artifacts"]] == ["decode", "tail"]
    for a in c["artifacts"]:
        assert a["format"] == "neff" and a["path"] is None and a["status"].startswith("skipped")
        assert "--lnc=1" in a["flags"] and a["compiler"]["name"] == "neuronx-cc"
        assert {i["kind"] for i in a["inputs"]} >= {"weight", "control"}
    assert run_cli("check", str(out), "-q").returncode == 0


def test_require_neff_fails(tmp_path):
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn2.yaml"), "--out", str(tmp_path / "b"), "-q",
                "--require-neff")
    assert r.returncode == 1
    assert r.stderr.strip().startswith("gkbuild: error: --require-neff: Neuron SDK not installed")
    assert not (tmp_path / "b" / "manifest.json").exists()


FAKE_CC = '''#!{python}
"""A stand-in neuronx-cc: records its argv, writes a NEFF of the documented layout."""
import json, sys
sys.path.insert(0, {tests!r})
from tests.compile.neff_files import make
argv = sys.argv[1:]
out = argv[argv.index("--output") + 1]
open(out, "wb").write(make(name=out.rsplit("/", 1)[-1], lnc=1))
with open({log!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
'''


def _fake_sdk(root, decode_params, tail_params, calls_log):
    """Importable stand-ins for torch_neuronx, torch_xla, neuronxcc, nki and the two kernels."""
    def write(rel, text):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))

    write("torch_neuronx/__init__.py", "")
    write("neuronxcc/__init__.py", "")
    write("nki/__init__.py", "")
    write("nki/collectives.py", "class ReplicaGroup:\n    def __init__(self, groups):\n        self.groups = groups\n")
    write("torch_xla/__init__.py", "class _XLAC:\n    @staticmethod\n    def _get_xla_tensors_hlo_proto(t):\n"
                                   "        return b'HloModuleProto:' + str(len(t)).encode()\n")
    write("torch_xla/core/__init__.py", "")
    write("torch_xla/core/xla_model.py", "def xla_device():\n    return 'cpu'\n")
    for mod, fn, params in (
            ("nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental/gpt_oss/gpt_oss_decode_layer_dp_tp_ep.py",
             "gpt_oss_decode_mega_kernel", decode_params),
            ("nkilib/experimental/gpt_oss_tail.py", "gpt_oss_tail_chunked_megakernel", tail_params)):
        args = ", ".join(f"{p}=None" for p in params)
        write(mod, f"""
            import json, torch
            def {fn}({args}):
                a = dict(locals())
                with open({str(calls_log)!r}, "a") as f:
                    f.write(json.dumps({{"kernel": "{fn}", "args": sorted(k for k, v in a.items() if v is not None)}}) + "\\n")
                return torch.zeros(1)
            """)
    for pkg in ("nkilib_src", "nkilib_src/nkilib", "nkilib_src/nkilib/models", "nkilib_src/nkilib/models/gpt_oss",
                "nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel",
                "nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental",
                "nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental/gpt_oss", "nkilib",
                "nkilib/experimental"):
        (root / pkg / "__init__.py").touch()


def test_the_whole_neuron_flow_through_a_fake_sdk(tmp_path, monkeypatch):
    p = make_plan(recipe.load(RECIPES / "tiny-topology-trn2.yaml"), preset("tiny-topology"))
    dec, tl = signature.decode(p), signature.tail(p)
    decode_params = sorted(set(neuron.tensor_names(dec).values()) | set(neuron.kernel_arguments(p, "decode"))
                           | {"rank_id"})
    tail_params = sorted(set(neuron.tensor_names(tl).values()) | set(neuron.kernel_arguments(p, "tail")))
    sdk = tmp_path / "sdk"
    calls = tmp_path / "kernel_calls.jsonl"
    _fake_sdk(sdk, decode_params, tail_params, calls)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    cc_log = tmp_path / "cc_argv.jsonl"
    cc = bindir / "neuronx-cc"
    cc.write_text(FAKE_CC.format(python=sys.executable, tests=str(os.path.dirname(os.path.dirname(
        os.path.dirname(__file__)))), log=str(cc_log)))
    cc.chmod(0o755)
    monkeypatch.syspath_prepend(str(sdk))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    assert neuron.sdk() is None
    out = tmp_path / "b"
    res = compile_build(recipe.load(RECIPES / "tiny-topology-trn2.yaml"), out=out, quiet=True, require_neff=True)
    c = res.manifest["compile"]
    assert c["status"] == "ok" and [s.status for s in res.stages if s.name == "compile"] == ["ran"]
    for a in c["artifacts"]:
        assert a["path"] == f"compiled/{a['name']}.neff" and a["format"] == "neff" and a["status"] == "ok"
        assert a["neff"]["lnc_size"] == 1 and a["neff"]["name"] == f"{a['name']}.neff"
        assert (out / a["path"]).stat().st_size == a["size"]
    kernels = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [k["kernel"] for k in kernels] == ["gpt_oss_decode_mega_kernel", "gpt_oss_tail_chunked_megakernel"]
    assert kernels[0]["args"] == decode_params  # every argument, each by the kernel's name
    argv = [json.loads(line) for line in cc_log.read_text().splitlines()]
    assert [a[:2] for a in argv] == [["compile", "--framework=XLA"]] * 2 and "--lnc=1" in argv[0]
    assert (out / ".gkbuild" / "neuron" / "decode.hlo.pb").read_bytes().startswith(b"HloModuleProto")
    assert run_cli("check", str(out), "-q").returncode == 0
    mf.load(out)
    # a kernel that does not take the per-buffer KV arguments is named, not silently mis-called
    _fake_sdk(sdk, [n for n in decode_params if not n.startswith("K_cache_buf")], tail_params, calls)
    for m in [m for m in sys.modules if m.startswith(("nkilib", "nkilib_src"))]:
        del sys.modules[m]
    with pytest.raises(GkError, match=r"does not take \['K_cache_buf_0'"):
        compile_build(recipe.load(RECIPES / "tiny-topology-trn2.yaml"), out=tmp_path / "c", quiet=True)
