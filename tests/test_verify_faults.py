"""The negative-test catalogue: every model-changing fault in tests/faults.py, applied to what a
build is made from, fails verify against the ORIGINAL checkpoint's golden at bf16 and at FP8 KV,
and the report names the part that departs (the fault's layer, or the tail's part). The faithful
build passes the same verify. An expert the golden never routes to is checked all the same."""

import pytest

from gkbuild import recipe, verify
from gkbuild.golden import default_prompts, for_checkpoint
from gkbuild.model import preset
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.reference import KvFormat
from tests import faults
from tests.conftest import RECIPES

KV = {"bf16": ([], KvFormat("bf16")),
      "fp8": (["kv_cache.dtype=fp8", "kv_cache.packed=true"], KvFormat("fp8_e4m3fn"))}
pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 3  # 4 prompt + 3 decode positions: enough for every fault to show


@pytest.fixture(scope="module")
def goldens(tiny_ckpt):
    prompts = default_prompts(preset("tiny").V, 4, 4)
    return {kv: for_checkpoint(tiny_ckpt, prompts, STEPS, fmt) for kv, (_, fmt) in KV.items()}


@pytest.fixture(scope="module")
def catalogue(goldens):
    return {f.name: f for f in faults.catalogue(preset("tiny"), faults.kth_expert(goldens["bf16"]))}


@pytest.fixture(scope="module")
def sources(tiny_ckpt, catalogue, tmp_path_factory):
    """One edited checkpoint copy per checkpoint fault, shared by both KV formats."""
    root = tmp_path_factory.mktemp("faulty")
    return {name: (faults.edit_copy(tiny_ckpt, root / str(i), f.edit) if f.edit else tiny_ckpt)
            for i, (name, f) in enumerate(catalogue.items())}


def _build(tmp_path, source, kv, fault=None):
    r = recipe.load(RECIPES / "tiny-cpu.yaml", [f"source={source}", *KV[kv][0]])
    with faults.patched(fault) if fault else _nothing():
        compile_build(r, out=tmp_path / "b", quiet=True, compile=False)
    return tmp_path / "b"


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("kv", KV)
def test_faithful_build_passes_tightly(tmp_path, tiny_ckpt, goldens, kv):
    rep = verify.run(_build(tmp_path, tiny_ckpt, kv), golden=goldens[kv])
    assert rep.ok and rep.kv == "tight", rep.to_dict()
    assert rep.max_abs_err <= 0.05 and rep.routing_forced <= 0.02 * rep.routing_total
    assert max(rep.layer_errors) < verify.LAYER_TOL["tight"] / 5 and not any(rep.layer_routing)
    assert max(rep.layer_local_errors) < rep.blame_threshold and not rep.experts_failing and not rep.tail_departs


CASES = [f.name for f in faults.catalogue(preset("tiny"), 0)]


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.split(" (")[0] for c in CASES])
def test_fault_fails_with_its_layer_named(tmp_path, goldens, catalogue, sources, kv, index):
    fault = list(catalogue.values())[index]
    out = _build(tmp_path, sources[fault.name], kv, fault)
    rep = verify.run(out, golden=goldens[kv], other_checkpoint=True)
    assert not rep.ok, (fault.name, rep.to_dict())
    assert rep.first_bad_layer == fault.layer, (fault.name, rep.layer_errors, rep.layer_local_errors, rep.culprit)
    assert rep.culprit.startswith(fault.culprit), (fault.name, rep.culprit)


@pytest.fixture(scope="module")
def topo_goldens(topo_ckpt):
    """tiny-topology's 128 experts: 4 prompts x 7 positions leave dozens of them unrouted."""
    prompts = default_prompts(preset("tiny-topology").V, 4, 4)
    return {kv: for_checkpoint(topo_ckpt, prompts, STEPS, fmt) for kv, (_, fmt) in KV.items()}


@pytest.mark.parametrize("kv", KV)
def test_a_fault_in_an_expert_no_prompt_routes_to_fails_and_names_it(tmp_path, topo_ckpt, topo_goldens, kv):
    g = topo_goldens[kv]
    layer = 1
    expert = faults.unused_experts(g, layer)[0]  # the golden's prompts never route to it
    fault = faults.unused_expert_fault(layer, expert)
    source = faults.edit_copy(topo_ckpt, tmp_path / "ck", fault.edit)
    rep = verify.run(_build(tmp_path, source, kv), golden=g, other_checkpoint=True)
    assert rep.max_abs_err < 1e-2 and rep.first_failure is None  # the logits cannot see it
    assert not rep.ok and rep.first_bad_layer == layer and rep.culprit.startswith(fault.culprit), rep.culprit
    assert [(x["layer"], x["expert"]) for x in rep.experts_failing] == [(layer, expert)]
    assert rep.experts_checked == 2 * 128 and rep.coverage[layer] < 128


def test_a_nan_in_an_expert_no_prompt_routes_to_fails(tmp_path, topo_ckpt, topo_goldens):
    """A scale byte of 255 (NaN in E8M0) that reaches an unrouted expert's shard: its probe rows
    are NaN, which is a departure, not a pass."""
    import numpy as np

    from gkbuild.layout import experts_mx

    g = topo_goldens["bf16"]
    expert = faults.unused_experts(g, 1)[0]
    fault = faults.Fault("a NaN scale in an unused expert's tile", 1, patch=lambda mp: faults.nth_call(
        mp, experts_mx, "gate_up_scales", 2, lambda S, *a: _nan_scale(S, expert)))
    rep = verify.run(_build(tmp_path, topo_ckpt, "bf16", fault), golden=g)
    assert not rep.ok and rep.first_bad_layer == 1 and [x["expert"] for x in rep.experts_failing] == [expert]
    assert rep.to_dict()["experts"]["failing"][0]["error"] is None  # strict JSON: an infinite error is null


def _nan_scale(S, expert):
    S = S.copy()
    S[expert].reshape(-1)[0] = 255
    return S
