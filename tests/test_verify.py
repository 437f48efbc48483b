"""gkbuild verify: builds pass against transformers; broken layouts fail and are attributed."""

import numpy as np
import pytest

from gkbuild import recipe, verify
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.checkpoint.source import materialize, parse
from gkbuild.errors import GkError
from gkbuild.golden import Golden, default_prompts, for_checkpoint
from gkbuild.layout import attention, experts_mx, hidden
from gkbuild.layout import kv as kvlayout
from tests.conftest import RECIPES, run_cli

TP2 = ["target=trn2", "topology.tp=2", "topology.ep=2", "topology.vtp=2", "decode.batch_sizes=[4]"]
FP8 = ["kv_cache.dtype=fp8", "kv_cache.packed=true"]


@pytest.fixture(scope="module")
def tiny_golden():
    root = materialize(parse("synth://tiny?layers=2&seed=0"))
    return for_checkpoint(root, default_prompts(4096, 4, 4), steps=16)


def _build(tmp_path, name, sets=(), recipe_file="tiny-cpu.yaml"):
    out = tmp_path / name
    compile_build(recipe.load(RECIPES / recipe_file, list(sets)), out=out, quiet=True, compile=False)
    return out


@pytest.mark.parametrize("sets", [[], FP8, ["experts=bf16"], TP2], ids=["bf16-kv", "packed-fp8-kv", "bf16-experts",
                                                                       "tp2"])
def test_tiny_builds_pass(tmp_path, tiny_golden, sets):
    rep = verify.run(_build(tmp_path, "b", sets), golden=tiny_golden)
    assert rep.ok, rep.to_dict()
    assert len(rep.steps) == 20 and rep.steps[-1].step == 19  # 4 prompt + 16 decode positions
    assert rep.min_cosine > (0.999 if "kv_cache.dtype=fp8" in sets else 0.9999)


@pytest.mark.slow
@pytest.mark.parametrize("sets", [["kv_cache.dtype=bf16", "kv_cache.packed=false"], [], ["kv_cache.form=per_buffer"]],
                         ids=["bf16-kv", "packed-fp8-kv", "per-buffer-packed-fp8-kv"])
def test_tiny_topology_passes_emulated_over_128_ranks(tmp_path, sets):
    """In either KV form (stacked, the default, or per-buffer)."""
    out = _build(tmp_path, "topo", sets, "tiny-topology-trn2.yaml")
    rep = verify.run(out, steps=16)
    assert rep.ok, rep.to_dict()
    assert len(rep.steps) == 20


def _counting(monkeypatch, module, name, on_call, change):
    """Wrap a layout function so that its ``on_call``-th call (1-based) is changed: a shard job
    produces its layers in order, so the n-th call is layer n-1."""
    orig = getattr(module, name)
    calls = {"n": 0}

    def wrapped(*a, **kw):
        out = orig(*a, **kw)
        calls["n"] += 1
        return change(out) if calls["n"] == on_call else out

    monkeypatch.setattr(module, name, wrapped)


def test_swapped_tp_shards_fail_at_layer_0(tmp_path, tiny_golden, monkeypatch):
    orig = attention.qkv
    monkeypatch.setattr(attention, "qkv", lambda dims, t, *a: orig(dims, 1 - t, *a))
    out = _build(tmp_path, "swap", TP2)
    monkeypatch.undo()
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 0


def test_flipped_nibbles_of_one_expert_fail_at_its_layer(tmp_path, tiny_golden, monkeypatch):
    def flip_expert_0(W):
        W = W.copy()
        w = W[0]
        W[0] = ((w & 0x0F0F) << 4) | ((w >> 4) & 0x0F0F)  # low and high nibble of every byte swapped
        return W

    _counting(monkeypatch, experts_mx, "gate_up_weights", 2, flip_expert_0)  # layer 1 only
    out = _build(tmp_path, "nibbles")
    monkeypatch.undo()
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 1


def test_nonzero_padding_lanes_fail_at_layer_0(tmp_path, tiny_golden, monkeypatch):
    orig = hidden.to_kernel

    def dirty(x, axis, Hp):
        out = orig(x, axis, Hp)
        lanes = np.moveaxis(out, axis, 0)
        lanes[hidden.sigma(Hp) >= x.shape[axis]] = 1 if out.dtype.kind in "ui" else 0.5
        return out

    monkeypatch.setattr(hidden, "to_kernel", dirty)
    out = _build(tmp_path, "pad")
    monkeypatch.undo()
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 0


def test_swapped_packed_k_positions_fail_at_layer_0(tmp_path, tiny_golden, monkeypatch):
    out = _build(tmp_path, "fp8", FP8)
    orig = kvlayout.write_k
    monkeypatch.setattr(kvlayout, "write_k", lambda k_half, block, token, k, packed:
                        orig(k_half, block, token ^ 1 if packed else token, k, packed))
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 0


def test_missing_plus_one_on_the_up_bias_fails_at_its_layer(tmp_path, tiny_golden, monkeypatch):
    def drop_shift(B):
        B = B.copy()
        B[:, :, 1] -= experts_mx.UP_BIAS_SHIFT
        return B

    _counting(monkeypatch, experts_mx, "gate_up_bias", 2, drop_shift)  # layer 1 only
    out = _build(tmp_path, "bias")
    monkeypatch.undo()
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 1


def test_golden_file_and_cli(tmp_path, tiny_golden):
    g = tmp_path / "g.safetensors"
    tiny_golden.save(g)
    again = Golden.load(g)
    assert again.prompt_len == 4 and again.token_ids.shape == (4, 20) and again.routing.shape == (4, 2, 20, 4)
    out = _build(tmp_path, "ok")
    r = run_cli("verify", str(out), "--golden", str(g))
    assert r.returncode == 0, r.stderr
    assert "max |err|" in r.stdout and "FAIL" not in r.stdout
    # a golden of another checkpoint is refused before any step runs
    other = for_checkpoint(materialize(parse("synth://tiny?layers=2&seed=1")), [[1, 2, 3, 4]], steps=1)
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(GkError, match="another checkpoint"):
        verify.run(out, golden=tmp_path / "other.safetensors")


def test_cli_failure_is_one_line_and_nonzero(tmp_path, tiny_golden, monkeypatch):
    g = tmp_path / "g.safetensors"
    tiny_golden.save(g)
    orig = attention.qkv
    monkeypatch.setattr(attention, "qkv", lambda dims, t, *a: orig(dims, 1 - t, *a))
    out = _build(tmp_path, "swap", TP2)
    monkeypatch.undo()
    r = run_cli("verify", str(out), "--golden", str(g))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("gkbuild: error: verify failed: sequence")
    assert "first hidden state to depart from the reference is layer 0" in r.stderr
