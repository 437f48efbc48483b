"""The inductor backend: .pt2 programs of the tiny build, compiled once for the module."""

import json
import platform
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from gkbuild import recipe, reference, verify
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.compile import inductor
from gkbuild.errors import GkError
from gkbuild.kernels.driver import Session
from gkbuild.runtime import Build
from tests.conftest import RECIPES, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("aoti") / "tiny"
    res = compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=out, quiet=True)
    return out, res


def test_artifacts_and_manifest_entries(built):
    out, res = built
    m = mf.load(out)
    c = m["compile"]
    assert c["status"] == "ok" and c["backend"] == "inductor"
    assert [a["name"] for a in c["artifacts"]] == ["decode", "tail"]
    for a in c["artifacts"]:
        assert a["format"] == "aoti-pt2" and a["target"] == "cpu" and a["status"] == "ok"
        assert a["compiler"] == {"name": "torch-aotinductor", "version": torch.__version__}
        assert "--dynamic-batch=1..4" in a["flags"]
        assert (out / a["path"]).stat().st_size == a["size"] and a["path"] in {f["path"] for f in m["files"]}
        if platform.machine() == "x86_64":
            assert {"--machine=x86_64", "--march=x86-64-v3", "--simdlen=256"} <= set(a["flags"])
            assert _compile_commands(out / a["path"]) == {"-march=x86-64-v3 CPU_CAPABILITY_AVX2"}
    dec = c["artifacts"][0]
    kinds = {i["name"]: i["kind"] for i in dec["inputs"]}
    assert kinds["x"] == "activation" and kinds["block_table_swa"] == "control"
    assert kinds["W_qkv"] == "weight" and kinds["K_cache"] == "kv_buffer"
    assert next(i for i in dec["inputs"] if i["name"] == "W_qkv")["file"] == "weights/attn-tp0.safetensors"
    assert dec["inputs"][0]["shape"] == ["batch", 1024] and "in-place" in dec["kv_update"]
    assert run_cli("check", str(out), "-q").returncode == 0


def _compile_commands(pt2: Path) -> set[str]:
    """The ISA each C++ file of a package was compiled for, from the commands inductor leaves in them."""
    seen = set()
    with zipfile.ZipFile(pt2) as z:
        for name in z.namelist():
            if name.endswith(".cpp"):
                for line in z.read(name).decode().splitlines():
                    if line.startswith("// g++") and ".cpp " in line:  # a compile, not the link
                        march = re.findall(r"-march=\S+", line)
                        cap = re.findall(r"CPU_CAPABILITY_\w+", line)
                        seen.add(" ".join(march + cap))
    return seen


def test_a_program_compiled_for_another_machine_is_refused_before_it_is_loaded(built, tmp_path):
    out, _ = built
    b = tmp_path / "b"
    shutil.copytree(out, b)
    m = json.loads((b / "manifest.json").read_text())
    flags = m["compile"]["artifacts"][0]["flags"]
    m["compile"]["artifacts"][0]["flags"] = [f for f in flags if not f.startswith("--machine=")] + ["--machine=riscv64"]
    m["build_id"] = mf.build_id(m)
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(GkError, match=rf"decode.pt2: refused: native code compiled for 'riscv64', and this host "
                                      rf"is {platform.machine()}"):
        Build.open(b).program("decode")


def test_compiled_agrees_with_the_twin(built):
    """fp32 hidden states agree to 1e-4 (relative); logits to what the tail's bf16 operands allow
    (a 1e-5 change in the normalized hidden can flip one bf16 rounding: ~one ulp of a logit)."""
    out, _ = built
    b = Build.open(out)
    twin, comp = Session(b, 4, 24), Session(b, 4, 24, engine="compiled")
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        tokens = torch.randint(0, 4096, (4,), generator=g)
        a, c = twin.step(tokens, collect_hiddens=True), comp.step(tokens, collect_hiddens=True)
        for x, y in zip(a.hiddens, c.hiddens):
            assert (x - y).abs().max() <= 1e-4 * x.abs().max()
        assert (a.logits - c.logits).abs().max() < 1.5e-2
        top2 = a.logits.topk(2).values
        decisive = (top2[:, 0] - top2[:, 1]) > 0.05
        assert torch.equal(a.tokens[decisive], c.tokens[decisive])
    # the compiled program wrote the KV cache in place, as the twin did
    diff = (twin.kv[0].allocations[0].float() - comp.kv[0].allocations[0].float()).abs().max()
    assert comp.kv[0].allocations[0].float().abs().sum() > 0 and diff < 0.02


def test_compiled_engine_passes_verify(built):
    out, _ = built
    rep = verify.run(out, steps=16, engine="compiled")
    assert rep.ok, rep.to_dict()
    r = run_cli("verify", str(out), "--engine", "compiled", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"]
    assert "Device information mismatch" not in r.stderr  # the portable target's, expected: quiet (issue 36)


def test_a_tie_the_compiled_programs_cannot_be_steered_at_is_not_judged_from_there_on(built):
    """A compiled program takes no routing guide: from a true tie of the reference (here made at
    sequence 0, layer 1, position 3 of a real golden) that layer and, through the KV, every later
    position of the sequence are left out, and the tie counts as forced; sequence 1 is judged whole."""
    from gkbuild.golden import default_prompts, for_checkpoint
    from gkbuild.checkpoint.source import materialize, parse

    out, _ = built
    m = mf.load(out)
    g = for_checkpoint(materialize(parse(m["source"]["uri"])), default_prompts(4096, 2, 4), 4, reference.build_kv(m))
    g.router_gap[0, 1, 3] = 0.0
    rep = verify.run(out, golden=g, engine="compiled")
    assert rep.ok and rep.unjudged == 8 - 3 and rep.routing_forced >= 1, rep.to_dict()
    errors = rep.to_dict()["position_errors"]  # an unjudged position is null
    assert [e is None for e in errors[0]] == [False] * 3 + [True] * 5 and None not in errors[1]


def test_recompiles_only_for_a_new_compiler(built, monkeypatch, tmp_path):
    out, first = built
    b = tmp_path / "b"
    shutil.copytree(out, b)
    again = compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=b, quiet=True)
    assert {s.name: s.status for s in again.stages}["compile"] == "cached"
    assert again.manifest["build_id"] == first.manifest["build_id"]
    built_programs = []

    def fake_build(program, sig, batch_sizes, target, path, key):
        built_programs.append(sig.program)
        path.write_bytes(b"a package from the new compiler")

    monkeypatch.setattr(inductor, "compiler", lambda: {"name": "torch-aotinductor", "version": "99.0"})
    monkeypatch.setattr(inductor, "build", fake_build)
    res = compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=b, quiet=True)
    assert built_programs == ["decode", "tail"] and {s.name: s.status for s in res.stages}["compile"] == "ran"
    assert res.manifest["compile"]["artifacts"][0]["compiler"]["version"] == "99.0"


def test_the_loader_refuses_what_does_not_match(built, tmp_path):
    out, _ = built
    b = tmp_path / "b"
    shutil.copytree(out, b)
    p = b / "compiled/decode.pt2"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(GkError, match=r"decode.pt2: refused: sha256 .* is not the manifest's"):
        Build.open(b).program("decode")
    m = json.loads((b / "manifest.json").read_text())
    m["compile"]["artifacts"][1]["compiler"]["version"] = "1.0.0"
    m["build_id"] = mf.build_id(m)  # a consistent manifest from another torch, not an edited one
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(GkError, match=r"tail.pt2: refused: compiled by torch 1.0.0"):
        Build.open(b).program("tail")


def test_cuda_target_without_a_gpu_is_skipped_and_said(tmp_path):
    r = run_cli("compile", str(RECIPES / "tiny-cpu.yaml"), "--set", "target=cuda", "--out", str(tmp_path / "c"), "-q")
    assert r.returncode == 0, r.stderr
    assert "CUDA is not available" in r.stderr
    m = mf.load(tmp_path / "c")
    assert m["compile"]["status"].startswith("skipped: CUDA is not available")
