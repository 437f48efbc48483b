"""gkbuild verify: builds pass against transformers; broken layouts fail and are attributed."""

import contextlib

import numpy as np
import pytest
import torch

from gkbuild import recipe, reference, verify
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.checkpoint.source import materialize, parse
from gkbuild.errors import GkError
from gkbuild.golden import TENSORS, Golden, default_prompts, for_checkpoint
from gkbuild.kernels.decode import RoutingGuide, route
from gkbuild.runtime import Build
from gkbuild.layout import attention, embedding, experts_mx, hidden
from gkbuild.layout import kv as kvlayout
from gkbuild.model import preset
from gkbuild.reference import KvFormat
from tests import faults
from tests.conftest import RECIPES, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

TP2 = ["target=trn2", "topology.tp=2", "topology.ep=2", "topology.vtp=2", "decode.batch_sizes=[4]"]
FP8 = ["kv_cache.dtype=fp8", "kv_cache.packed=true"]
VOCAB_FUSED = ["decode.embedding=vocab", "decode.rope=fused"]


@pytest.fixture(scope="module")
def tiny_golden():
    root = materialize(parse("synth://tiny?layers=2&seed=0"))
    return for_checkpoint(root, default_prompts(4096, 4, 4), steps=16)


@pytest.fixture(scope="module")
def tiny_golden_fp8(tiny_golden):
    """The same sequences through a reference whose KV cache rounds like a cpu build's FP8 one."""
    root = materialize(parse("synth://tiny?layers=2&seed=0"))
    return for_checkpoint(root, tiny_golden.token_ids[:, :4].tolist(), steps=16, kv=KvFormat("fp8_e4m3fn"))


def _build(tmp_path, name, sets=(), recipe_file="tiny-cpu.yaml"):
    out = tmp_path / name
    compile_build(recipe.load(RECIPES / recipe_file, list(sets)), out=out, quiet=True, compile=False)
    return out


@pytest.mark.parametrize("sets", [[], FP8, ["experts=bf16"], TP2, TP2 + VOCAB_FUSED, TP2 + ["decode.embedding=hidden"]],
                         ids=["bf16-kv", "packed-fp8-kv", "bf16-experts", "tp2", "tp2-vocab-fused-rope", "tp2-hidden"])
def test_tiny_builds_pass_tightly(tmp_path, tiny_golden, tiny_golden_fp8, sets):
    golden = tiny_golden_fp8 if "kv_cache.dtype=fp8" in sets else tiny_golden
    rep = verify.run(_build(tmp_path, "b", sets), golden=golden)
    assert rep.ok and rep.kv == "tight", rep.to_dict()
    assert len(rep.steps) == 20 and rep.steps[-1].step == 19  # 4 prompt + 16 decode positions
    assert rep.max_abs_err <= 0.05 and rep.min_cosine > 0.9999
    assert rep.routing_forced <= 0.02 * rep.routing_total
    stages = rep.to_dict()["stages"]  # where the time went, for --json
    assert {"golden", "open", "embed", "layers", "tail", "tail check", "compare", "texts"} <= set(stages), stages
    assert all(v["wall"] >= 0 and v["cpu"] >= 0 for v in stages.values()) and stages["layers"]["cpu"] > 0


def test_a_forced_golden_of_a_given_continuation_judges_every_position(tmp_path, tiny_golden):
    """A forced golden (``golden --forced``: one layer-major pass over prompt + a continuation the
    reference would not have chosen) verifies a faithful build at the tight tier at every one of its
    positions, the build teacher-forced on the given tokens; the same build with o_proj x1.01 at layer 0
    fails against it, naming layer 0."""
    root = materialize(parse("synth://tiny?layers=2&seed=0"))
    prompts = tiny_golden.token_ids[:, :4].tolist()
    cont = [list(reversed(s)) for s in tiny_golden.token_ids[:, 4:].tolist()]  # not the greedy tokens
    forced = for_checkpoint(root, prompts, 0, continuations=cont)
    assert forced.meta["mode"] == "forced" and forced.token_ids[:, 4:].tolist() == cont
    assert not torch.equal(forced.token_ids, tiny_golden.token_ids)
    rep = verify.run(_build(tmp_path, "b"), golden=forced)
    assert rep.ok and rep.kv == "tight", rep.to_dict()
    assert len(rep.steps) == 20 and rep.max_abs_err <= 0.05
    o_proj = [f for f in faults.catalogue(preset("tiny"), 0) if f.name == "o_proj x1.01 (layer 0)"][0]
    bad = faults.edit_copy(root, tmp_path / "ck", o_proj.edit)
    rep = verify.run(_build(tmp_path, "bad", [f"source={bad}"]), golden=forced, other_checkpoint=True)
    assert not rep.ok and rep.culprit.startswith("layer 0"), rep.to_dict()


def test_leading_is_the_stable_sorts_first_k():
    """compare's top-k sets without sorting the vocabulary: the same indices, in the same order, as a
    stable descending sort, ties (at the k-th value too) in index order."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        ref = torch.randint(0, 12, (n,), generator=g).float() if trial % 2 else torch.randn(n, generator=g)
        if trial % 5 == 0:
            ref[::3] = float("-inf")
        if trial % 11 == 0:
            ref[1::7] = float("nan")
        for k in (1, 5, 50, 1000, 5000):
            assert torch.equal(verify.leading(ref, k), torch.argsort(ref, descending=True, stable=True)[:k]), (trial, k)


def test_a_golden_of_another_kv_format_is_refused_unless_loose(tmp_path, tiny_golden):
    out = _build(tmp_path, "fp8", FP8)
    with pytest.raises(GkError, match=r"golden emulates a bf16 KV cache and the build stores fp8_e4m3fn.*"
                                      r"--kv fp8_e4m3fn.*--loose"):
        verify.run(out, golden=tiny_golden)
    rep = verify.run(out, golden=tiny_golden, loose=True)
    assert rep.ok and rep.kv == "loose", rep.to_dict()


def test_routing_is_forced_only_at_the_references_own_ties():
    logits = torch.tensor([[4.0, 3.0, 2.999, 0.0], [4.0, 3.0, 2.5, 0.0], [4.0, 3.0, 2.999, 0.0]])
    ref = torch.tensor([[[0, 2], [0, 2], [0, 1]]])  # the reference's choices for the 3 tokens
    gap = torch.tensor([[0.005, 0.005, 0.5]])  # its margins: ties, ties, a clear choice
    guide = RoutingGuide(ref, gap, verify.TIE)
    idx, _ = route(logits, 2, guide)
    # token 0: a true tie in the reference: its set is taken; token 1: also a tie by the
    # reference's margin, though our own logits are 0.5 apart; token 2: same set, nothing to do
    assert idx[0].tolist() == [0, 2] and idx[1].tolist() == [0, 2] and idx[2].tolist() == [0, 1]
    assert guide.forced == 2 and not guide.departed.any()
    # the reference chose clearly (margin 0.5) and we differ: kept, and recorded as a departure,
    # however near our own logits are to a tie
    guide = RoutingGuide(torch.tensor([[[0, 2]]]), torch.tensor([[0.5]]), verify.TIE)
    idx, _ = route(torch.tensor([[4.0, 3.0, 2.9999, 0.0]]), 2, guide)
    assert idx[0].tolist() == [0, 1] and guide.forced == 0 and guide.departed.tolist() == [[True]]


def test_forced_ties_are_judged_as_distinct_token_layers():
    """A handful of ties never fails a short verify; a share above MAX_FORCED of the distinct
    (sequence, position, layer) token-layers does."""
    rep = verify.Report([], True, "tight", routing_forced=verify.MIN_FORCED, routing_total=160)
    assert not rep.too_many_forced  # 4 of 160 (2.5%): within the allowance
    rep.routing_forced = verify.MIN_FORCED + 1
    assert rep.too_many_forced
    rep.routing_forced, rep.routing_total = 90, 4608  # 36 layers x 4 x 32: 2% is 92
    assert not rep.too_many_forced
    rep.routing_forced = 93
    assert rep.too_many_forced


def test_a_verify_that_forces_too_many_routings_fails(tmp_path, tiny_golden):
    import dataclasses

    E = 8
    fake = dataclasses.replace(tiny_golden, routing=(tiny_golden.routing + 1) % E,
                               router_gap=torch.zeros_like(tiny_golden.router_gap))
    rep = verify.run(_build(tmp_path, "b"), golden=fake)
    assert not rep.ok and rep.too_many_forced and rep.routing_forced > 0.02 * rep.routing_total


@pytest.mark.slow
@pytest.mark.parametrize("sets", [["kv_cache.dtype=bf16", "kv_cache.packed=false"], [], ["kv_cache.form=paired"]],
                         ids=["bf16-kv", "packed-fp8-kv", "paired-packed-fp8-kv"])
def test_tiny_topology_passes_tightly_emulated_over_128_ranks(tmp_path, sets):
    """In either KV form (stacked, the default, or paired), against the golden verify computes
    in the build's KV format (trn3 FP8: OCP e4m3fn, max 448): max error and forced routings at the bf16
    level, FP8 or not."""
    out = _build(tmp_path, "topo", sets, "tiny-topology-trn3.yaml")
    rep = verify.run(out, steps=16)
    assert rep.ok and rep.kv == "tight", rep.to_dict()
    assert rep.build_kv.startswith("bf16" if "kv_cache.dtype=bf16" in sets else "fp8_e4m3fn ")
    assert len(rep.steps) == 20
    assert rep.max_abs_err <= 0.05 and rep.routing_forced <= 0.02 * rep.routing_total


@pytest.mark.slow
def test_tiny_topology_passes_with_every_embedding_placement_and_rope_mode(tmp_path):
    """host/host is the test above; here the kernel's fused forms (vocab-sharded embedding through
    the reduce-scatter, hidden-sharded through the TP all-to-all, fused RoPE from inv_freq) over all
    128 emulated ranks. Every form is exact, so the reports are the same to the last bit."""
    golden, reports = None, {}
    for sets in (["decode.embedding=vocab", "decode.rope=fused"], ["decode.embedding=hidden"], ["decode.rope=fused"]):
        out = _build(tmp_path, "-".join(sets), sets, "tiny-topology-trn3.yaml")
        if golden is None:  # one golden (4 steps) in the builds' KV format, shared
            golden = for_checkpoint(materialize(parse("synth://tiny-topology?layers=2&seed=0")),
                                    default_prompts(2048, 4, 4), 4, reference.build_kv(Build.open(out).manifest))
        rep = verify.run(out, golden=golden)
        assert rep.ok and rep.kv == "tight", (sets, rep.to_dict())
        assert len(rep.steps) == 8
        reports[" ".join(sets)] = {k: v for k, v in rep.to_dict().items() if k != "stages"}  # all but timings
    first = next(iter(reports.values()))
    assert all(r == first for r in reports.values()), reports


def test_swapped_tp_shards_fail_at_layer_0(tmp_path, tiny_golden, monkeypatch):
    orig = attention.heads
    monkeypatch.setattr(attention, "heads", lambda dims, t: orig(dims, 1 - t))
    out = _build(tmp_path, "swap", TP2)
    monkeypatch.undo()
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 0


def test_a_wrong_vocab_owner_rule_fails_at_layer_0(tmp_path, tiny_golden, monkeypatch):
    out = _build(tmp_path, "vocab", TP2 + VOCAB_FUSED)
    orig = embedding.local_ids
    monkeypatch.setattr(embedding, "local_ids", lambda ids, rank, rows: orig(ids, 1 - rank, rows))
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 0


def test_flipped_nibbles_of_one_expert_fail_at_its_layer(tmp_path, tiny_golden, monkeypatch):
    def flip_expert_0(W):
        W = W.copy()
        w = W[0]
        W[0] = ((w & 0x0F0F) << 4) | ((w >> 4) & 0x0F0F)  # low and high nibble of every byte swapped
        return W

    faults.nth_call(monkeypatch, experts_mx, "gate_up_weights", 2, lambda W, *a: flip_expert_0(W))  # layer 1 only
    out = _build(tmp_path, "nibbles")
    monkeypatch.undo()
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 1


def test_experts_read_ahead_change_no_number_of_the_report(tmp_path, tiny_golden, monkeypatch):
    """Verify reads every rank's experts ahead on other threads (kernels.ahead): on a TP2 x EP2
    build with one expert of one rank damaged, its report is, bit for bit, the one of a replay in
    which each rank reads its experts when it needs them; the damaged expert is still named."""
    from gkbuild.kernels.replay import Replay

    def flip_expert_1(W):
        W = W.copy()
        W[1] = ((W[1] & 0x0F0F) << 4) | ((W[1] >> 4) & 0x0F0F)
        return W

    faults.nth_call(monkeypatch, experts_mx, "gate_up_weights", 2, lambda W, *a: flip_expert_1(W))
    out = _build(tmp_path, "tp2", TP2)
    monkeypatch.undo()
    ahead = verify.run(out, golden=tiny_golden).to_dict()
    monkeypatch.setattr(Replay, "experts_ahead", lambda self, budget: contextlib.nullcontext())
    inline = verify.run(out, golden=tiny_golden).to_dict()
    assert ahead.pop("stages") and inline.pop("stages")
    assert ahead == inline
    assert not ahead["ok"] and ahead["experts"]["failing"], ahead["experts"]


def test_nonzero_padding_lanes_fail_at_layer_0(tmp_path, tiny_golden, monkeypatch):
    faults.dirty_pads(monkeypatch)
    out = _build(tmp_path, "pad")
    monkeypatch.undo()
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 0


def test_swapped_packed_k_positions_fail_at_layer_0(tmp_path, tiny_golden_fp8, monkeypatch):
    out = _build(tmp_path, "fp8", FP8)
    orig = kvlayout.write_k
    monkeypatch.setattr(kvlayout, "write_k", lambda k_half, block, token, k, packed:
                        orig(k_half, block, token ^ 1 if packed else token, k, packed))
    rep = verify.run(out, golden=tiny_golden_fp8)
    assert not rep.ok and rep.first_bad_layer == 0


def test_missing_plus_one_on_the_up_bias_fails_at_its_layer(tmp_path, tiny_golden, monkeypatch):
    faults.drop_up_shift(monkeypatch, 1)  # layer 1 only
    out = _build(tmp_path, "bias")
    monkeypatch.undo()
    rep = verify.run(out, golden=tiny_golden)
    assert not rep.ok and rep.first_bad_layer == 1


def test_golden_file_and_cli(tmp_path, tiny_golden):
    g = tmp_path / "g.safetensors"
    tiny_golden.save(g)
    again = Golden.load(g)
    assert again.prompt_lens == [4] * 4 and again.token_ids.shape == (4, 20) and again.routing.shape == (4, 2, 20, 4)
    assert again.router_gap.shape == (4, 2, 20) and again.kv == KvFormat("bf16")
    out = _build(tmp_path, "ok")
    r = run_cli("verify", str(out), "--golden", str(g))
    assert r.returncode == 0, r.stderr
    assert "max |err|" in r.stdout and "FAIL" not in r.stdout
    # a golden of another checkpoint is refused before any step runs
    other = for_checkpoint(materialize(parse("synth://tiny?layers=2&seed=1")), [[1, 2, 3, 4]], steps=1)
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(GkError, match="another checkpoint.*--allow-other-checkpoint"):
        verify.run(out, golden=tmp_path / "other.safetensors")
    r = run_cli("verify", str(out), "--golden", str(tmp_path / "other.safetensors"), "--allow-other-checkpoint")
    assert "another checkpoint" not in r.stderr and "max |err|" in r.stdout  # compared (and failed: another model)


def test_cli_failure_is_one_line_and_nonzero(tmp_path, tiny_golden, monkeypatch):
    g = tmp_path / "g.safetensors"
    tiny_golden.save(g)
    orig = attention.heads
    monkeypatch.setattr(attention, "heads", lambda dims, t: orig(dims, 1 - t))
    out = _build(tmp_path, "swap", TP2)
    monkeypatch.undo()
    r = run_cli("verify", str(out), "--golden", str(g))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("gkbuild: error: verify failed: sequence")
    assert "the first part to depart from the reference is layer 0" in r.stderr


def test_progress_reports_every_layer_of_every_position(tmp_path, tiny_golden, monkeypatch):
    """verify's bar names the layer and the position (or the layer's experts, or the tail) in
    progress, and its units add up to its total (so its ETA is one of the whole run)."""
    seen, total = [], []

    def bar(description, n, quiet=False):
        import contextlib

        @contextlib.contextmanager
        def cm():
            total.append(n)
            yield lambda k, where="": seen.append((k, where))
        return cm()

    monkeypatch.setattr(verify, "steps_bar", bar)
    rep = verify.run(_build(tmp_path, "b"), golden=tiny_golden)
    assert rep.ok and sum(k for k, _ in seen) == total[0] == (20 + 8) + (2 * 20 + 8) + 20  # layers 0, 1, the tail
    wheres = [w for _, w in seen]
    assert wheres[:2] == ["layer 1/2, position 1/20", "layer 1/2, position 2/20"]
    assert wheres[20] == "layer 1/2, experts" and wheres[21] == "layer 2/2, position 1/20" and wheres[-1] == "tail"


def test_device_cuda_is_refused_without_a_gpu_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    out = _build(tmp_path, "b")
    for extra in ([], ["--engine", "compiled"]):
        r = run_cli("verify", str(out), "--device", "cuda", "--prompts", "1", "--steps", "1", *extra)
        assert r.returncode == 1 and r.stderr.strip() == "gkbuild: error: --device cuda: no CUDA device is available " \
                                                         "on this host"


@pytest.mark.parametrize("spoil, match", [
    (lambda g: setattr(g, "logits", g.logits.round().to(torch.int64)), "golden tensor logits is i64, not floating point"),
    (lambda g: g.logits[1, 2].fill_(float("nan")), "golden tensor logits holds NaN or infinite values: a bad golden"),
    (lambda g: g.hidden[0, 1, 3, 5].fill_(float("inf")), "golden tensor hidden holds NaN or infinite values"),
])
def test_a_golden_with_integer_or_nan_values_is_refused_as_a_bad_golden(built, tiny_golden, tmp_path, spoil, match):
    g = Golden(**{k: getattr(tiny_golden, k).clone() for k in TENSORS}, prompt_lens=tiny_golden.prompt_lens,
               meta=dict(tiny_golden.meta))
    spoil(g)
    g.save(tmp_path / "g.safetensors")
    with pytest.raises(GkError, match=match):
        Golden.load(tmp_path / "g.safetensors")
    if "logits" in match:  # as the probe saw it: through verify
        r = run_cli("verify", str(built), "--golden", str(tmp_path / "g.safetensors"))
        assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and match in r.stderr, r.stderr
