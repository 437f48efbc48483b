"""verify's layer-major engine: its live rows, and the same numbers as decoding step by step."""

import pytest
import torch

from gkbuild import recipe
from gkbuild.checkpoint.source import materialize, parse
from gkbuild.golden import default_prompts
from gkbuild.kernels import decode
from gkbuild.kernels.driver import Session
from gkbuild.kernels.replay import FREE, Replay, live_rows
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.reference import KvFormat, run as reference_run
from gkbuild.runtime import Build
from tests.conftest import RECIPES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("batch,dp,P", [(128, 16, 4), (128, 16, 16), (128, 16, 20), (4, 1, 4), (4, 1, 2), (8, 2, 1)])
def test_live_rows_are_distinct_and_spread_over_the_replicas(batch, dp, P):
    rows = live_rows(batch, dp, P)
    per = batch // dp
    assert len(rows) == P == len(set(rows)) and all(0 <= r < batch for r in rows)
    assert len({r // per for r in rows}) == min(P, dp)  # as many replicas as there are sequences
    if 1 < P <= dp:
        assert len({r % per for r in rows}) > 1  # and not always the same TP rank's x shard


@pytest.mark.parametrize("sets", [["kv_cache.form=paired"], []], ids=["paired", "stacked"])
def test_layer_major_replay_gives_the_step_by_step_numbers(tmp_path, sets):
    """The replay's free stream against Session.step over the same tokens (all rows of the
    batch live, the reference's routing as the guide): the same hidden states and logits, to
    summation order (which can flip a bf16 rounding of the tail's lm_head operand: ~1e-3 of a
    logit). Paired KV: a pair's layers draw blocks from one pool, sliding blocks freed
    and reused, and layer-major order must not mix them."""
    out = tmp_path / "b"
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", list(sets)), out=out, quiet=True, compile=False)
    build = Build.open(out)
    B, T = 4, 24  # past the sliding window (tiny: 8 positions), so sliding blocks are freed and reused
    ref = reference_run(materialize(parse("synth://tiny?layers=2&seed=0")), default_prompts(4096, B, 4), T - 4,
                        KvFormat("bf16"))
    s = Session(build, B, max_len=T, compact_kv=True)
    steps, hid = [], []
    for t in range(T):
        guide = decode.RoutingGuide(ref["routing"][:, :, t].transpose(0, 1), ref["router_gap"][:, :, t].T, 0.01)
        res = s.step(ref["token_ids"][:, t], collect_hiddens=True, guide=guide)
        steps.append(res.logits)
        hid.append(torch.stack(res.hiddens))
    s2 = Session(Build.open(out), B, max_len=T, compact_kv=True, kv=False)
    rp = Replay(s2, live_rows(B, 1, B), T)
    rp.embed(ref["token_ids"].T)
    for i in range(2):
        lo = rp.layer(i, None if i == 0 else ref["hidden"][:, i - 1].transpose(0, 1), ref["routing"][:, i].transpose(0, 1),
                      ref["router_gap"][:, i].T, ref["expert_outputs"].new_zeros(2, 960), 0.01)
        want = torch.stack(hid)[:, i]  # [T, B, H]
        assert float((lo.hidden[FREE] - want).abs().max()) <= 1e-4 * float(want.abs().max())
    logits = rp.tail()
    want = torch.stack(steps)
    assert float((logits - want).abs().max()) <= 5e-3
