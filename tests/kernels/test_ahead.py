"""Experts read ahead on other threads (verify's replay): each rank's own bytes, the numbers a rank
reads itself, in any order it asks, within a bounded number of buffers."""

import dataclasses
import random
import threading

import numpy as np
import pytest
import torch

from gkbuild.kernels import decode, mx
from gkbuild.kernels.ahead import ExpertsAhead
from gkbuild.layout import experts_mx
from gkbuild.layout.dims import Dims
from gkbuild.model import preset

L, E_L, RANKS = 2, 2, 3


def _rank(d: Dims, seed: int) -> dict:
    """One rank's MX expert tensors [L, E_L, ...], as a shard holds them."""
    rng = np.random.default_rng(seed)
    u16 = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.uint16)  # noqa: E731
    t = {}
    for name, make in (("gate_up", lambda: experts_mx.gate_up(
            d, rng.integers(0, 256, (E_L, 2 * d.I, d.H // 32, 16), dtype=np.uint8),
            rng.integers(118, 125, (E_L, 2 * d.I, d.H // 32), dtype=np.uint8),
            rng.normal(0, 0.1, (E_L, 2 * d.I)).astype(np.float32))),
                       ("down", lambda: experts_mx.down(
            d, rng.integers(0, 256, (E_L, d.H, d.I // 32, 16), dtype=np.uint8),
            rng.integers(118, 125, (E_L, d.H, d.I // 32), dtype=np.uint8),
            rng.normal(0, 0.1, (E_L, d.H)).astype(np.float32)))):
        layers = [make() for _ in range(L)]
        t[f"expert_{name}_weights"] = torch.stack([u16(w) for w, _, _ in layers])
        t[f"expert_{name}_weights_scale"] = torch.stack([torch.from_numpy(s) for _, s, _ in layers])
        t[f"expert_{name}_bias"] = torch.stack([torch.from_numpy(b) for _, _, b in layers])
    return t


@pytest.fixture(scope="module")
def ranks():
    d = Dims.of(dataclasses.replace(preset("tiny"), hidden_size=448, intermediate_size=960))
    ts = [_rank(d, 0) for _ in range(RANKS)]
    ts[1] = _rank(d, 1)  # a rank whose bytes differ from the others' (a damaged shard)
    sc = decode.Scalars(num_layers=L, eps=1e-5, hidden_actual=d.H, hidden_padded=d.Hp, top_k=2, softmax_scale=0.125,
                        gate_clamp_upper_limit=7.0, up_clamp_upper_limit=8.0, up_clamp_lower_limit=-6.0, k_scale=None,
                        v_scale=None, kv_dtype="bf16", packed=False, block_size=4, experts="mxfp4", ep_rank=0,
                        experts_per_rank=E_L)
    return ts, [dataclasses.replace(sc, ep_rank=r) for r in range(RANKS)]


def _jobs(ts, scs, order):
    return [((scs[r].ep_rank, i, e), ts[r], i, e, scs[r]) for i in range(L) for r in order for e in range(E_L)]


def _ahead(ts, scs, guess, slots: int, readers: int = 1) -> ExpertsAhead:
    """What replay makes: each rank's own tensors read, ``guess`` the order of the first layers."""
    def read(r, i, e, out):
        return decode.DecodedExpert(ts[r], i, e, scs[r], out)

    return ExpertsAhead(read, decode.buffer_sizes(ts[-1]), [(r, e) for r in guess for e in range(E_L)], L, slots,
                        readers)


def _same(a: decode.DecodedExpert, b: decode.DecodedExpert) -> bool:
    return all(torch.equal(x, y) for x, y in zip((*a.gate_up(), *a.down()), (*b.gate_up(), *b.down())))


def _until_ahead(ahead: ExpertsAhead, key, timeout: float = 30.0) -> None:
    """Wait until a reader has taken ``key`` (a rank never waits for a reader that has not: it makes the
    expert itself, so on a busy host the first asks can beat the readers' start)."""
    with ahead._cv:
        assert ahead._cv.wait_for(lambda: key in ahead._ready or key in ahead._reading, timeout), key


@pytest.mark.parametrize("readers", [1, 2])
def test_each_rank_gets_its_own_experts_read_ahead_in_the_order_asked(ranks, readers):
    """Asked in the order read: every expert comes from the reader (never made by the asker), each
    the DecodedExpert of its own rank's bytes, within ``slots`` buffers."""
    ts, scs = ranks
    slots, made, buffers = 3, [], set()
    with _ahead(ts, scs, range(RANKS), slots, readers) as ahead:
        for key, t, i, e, sc in _jobs(ts, scs, range(RANKS)):
            _until_ahead(ahead, key)
            ex = ahead.get(key, lambda: made.append(key))
            assert not made, made
            assert _same(ex, decode.DecodedExpert(t, i, e, sc)), key
            buffers.add(ex.gate_up()[0].untyped_storage().data_ptr())
    assert len(buffers) <= slots
    assert not _same(decode.DecodedExpert(ts[1], 0, 0, scs[1]), decode.DecodedExpert(ts[0], 0, 0, scs[0]))


def test_an_expert_asked_out_of_order_is_made_by_the_asker_and_the_rest_still_come_ahead(ranks):
    """The reader guesses the ranks' order; a rank asking another way gets the same numbers, made
    by itself where the guess missed, and a layer's leftovers do not block the next layer."""
    ts, scs = ranks
    asked = _jobs(ts, scs, [2, 0, 1])
    made = []
    with _ahead(ts, scs, range(RANKS), 2) as ahead:
        random.Random(0).shuffle(asked[:RANKS * E_L])  # layer 0 in a scrambled order, layer 1 another order
        for key, t, i, e, sc in asked:
            def make(key=key, t=t, i=i, e=e, sc=sc):
                made.append(key)
                return decode.DecodedExpert(t, i, e, sc)
            assert _same(ahead.get(key, make), decode.DecodedExpert(t, i, e, sc)), key
    assert 0 < len(made) < len(asked)  # some missed, and some came ahead even so


def test_a_reader_that_fails_leaves_the_asker_to_raise_its_own_error(ranks):
    """A rank whose tensors cannot be read: the readers stop, the rank's own read raises (one
    error, from the rank's own code path), the other ranks' experts are still right, and the
    readers end."""
    ts, scs = ranks
    ts = [{k: v for k, v in ts[0].items() if k != "expert_down_weights"}, *ts[1:]]
    with _ahead(ts, scs, range(RANKS), 2, readers=2) as ahead:
        with pytest.raises(KeyError, match="expert_down_weights"):
            ahead.get((0, 0, 0), lambda: decode.DecodedExpert(ts[0], 0, 0, scs[0]))
        for key, t, i, e, sc in _jobs(ts, scs, [1, 2]):
            assert _same(ahead.get(key, lambda: decode.DecodedExpert(t, i, e, sc)), decode.DecodedExpert(t, i, e, sc))
    assert not [th for th in threading.enumerate() if th.name.startswith("gkbuild-experts-ahead")]


def test_tiles_read_into_a_buffer_are_the_tiles_read_fresh(ranks):
    """mx's readers fill a given buffer (reused from expert to expert) with the numbers they return
    fresh, and return views of it."""
    ts, _ = ranks
    t = ts[0]
    gu, down = (torch.full((n,), float("nan")) for n in decode.buffer_sizes(t))
    for e in range(E_L):
        W, S = t["expert_gate_up_weights"][1, e], t["expert_gate_up_weights_scale"][1, e]
        got = mx.gate_up_rows(W, S, gu)
        assert torch.equal(got, mx.gate_up_rows(W, S)) and got.data_ptr() == gu.data_ptr()
        Wd, Sd = t["expert_down_weights"][1, e], t["expert_down_weights_scale"][1, e]
        got = mx.down_rows(Wd, Sd, down)
        assert torch.equal(got, mx.down_rows(Wd, Sd)) and got.data_ptr() == down.data_ptr()
