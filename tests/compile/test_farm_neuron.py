"""The farm's NEFF path, through the fake Neuron SDK and the stand-in kernel libraries: `gkbuild farm`
on a trn3 build of the tiny topology recipe traces and compiles each program in a job of its own (from the recipe alone) into
a folder cache; a host without the SDK then assembles the build from that cache, compiling nothing,
with the build id of a host that compiled it itself."""

import json

import pytest

from gkbuild import recipe
from gkbuild.compile import neuron
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from tests.compile.conftest import LIB_A, LIB_F
from tests.conftest import RECIPES, run_cli

TOPO = RECIPES / "tiny-topology-trn3.yaml"
SETS = ["target=trn3", f"compile.kernels.decode.library={LIB_A}", f"compile.kernels.tail.library={LIB_F}"]


@pytest.mark.slow
def test_a_trn_farm_fills_the_cache_and_a_host_without_the_sdk_assembles(fake_sdk, tmp_path, monkeypatch):
    store = tmp_path / "cache"
    r = run_cli("farm", str(TOPO), *sum((["--set", s] for s in SETS), []), "--cache", str(store), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [(j["program"], j["status"]) for j in rep["jobs"]] == [("decode-b128", "compiled"), ("tail-b128", "compiled")]
    own = compile_build(recipe.load(TOPO, SETS), out=tmp_path / "own", quiet=True, require_neff=True)
    monkeypatch.setattr(neuron, "sdk", lambda: "Neuron SDK not installed (no torch_neuronx)")
    got = compile_build(recipe.load(TOPO, SETS), out=tmp_path / "b", quiet=True, cache=str(store))
    stage = next(s for s in got.stages if s.name == "compile")
    assert got.manifest["compile"]["status"] == "ok" and "2 from the compile cache" in stage.detail
    assert {a["sha256"] for a in got.manifest["compile"]["artifacts"]} == {j["sha256"] for j in rep["jobs"]}
    assert got.manifest["build_id"] == own.manifest["build_id"]
    assert problems(tmp_path / "b") == []
