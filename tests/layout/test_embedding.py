"""The embedding's placements: every shard set reassembles to the checkpoint's table bit for bit."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gkbuild.layout import embedding, hidden, scalars
from gkbuild.layout.dims import Dims
from gkbuild.model import preset

BF = ml_dtypes.bfloat16


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _table(seed, V):
    """A checkpoint-like table [V, H] (including -0.0 and NaN payloads: bits, not values, must survive)."""
    rng = np.random.default_rng(seed)
    dims = Dims.of(dataclasses.replace(preset("tiny"), vocab_size=V), tp=8)
    w = rng.standard_normal((V, dims.H)).astype(BF)
    w.view(np.uint16)[0, :3] = (0x8000, 0x7FC1, 0xFF80)
    return dims, w


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([64, 67, 1000]), st.sampled_from([1, 3, 8, 16]))
def test_vocab_shards_reassemble_to_the_checkpoint(seed, V, world):
    dims, w = _table(seed, V)
    e = embedding.table(dims, w)
    shards = [embedding.vocab_shard(e, r, world) for r in range(world)]
    R = -(-V // world)
    assert all(s.shape == (R, dims.Hp) and s.dtype == BF and s.flags.c_contiguous for s in shards)
    padding = np.concatenate(shards)[V:]
    assert not _bits(padding).any()  # rows past V are zero
    back = embedding.table_inverse(dims, embedding.vocab_shards_inverse(shards, V))
    assert np.array_equal(_bits(back), _bits(w))


def test_vocab_inverse_refuses_non_zero_padding():
    dims, w = _table(0, 67)
    shards = [embedding.vocab_shard(embedding.table(dims, w), r, 8) for r in range(8)]
    shards[-1][-1, 0] = 1
    with pytest.raises(ValueError, match="padding"):
        embedding.vocab_shards_inverse(shards, 67)


@pytest.mark.parametrize("V, world", [(64, 8), (67, 8), (5, 8), (201088, 128)])
def test_every_id_has_exactly_one_owner_and_its_row(V, world):
    R = scalars.vocab_rows(V, world)
    ids = np.arange(V)
    local = np.stack([embedding.local_ids(ids, r, R) for r in range(world)])  # [world, V]
    assert local.dtype == np.int32
    assert ((local >= 0).sum(0) == 1).all()
    owner = (local >= 0).argmax(0)
    assert np.array_equal(owner, ids // R)
    assert np.array_equal(local[owner, ids], ids % R)
    for r in range(world):
        back = embedding.local_ids_inverse(local[r], r, R)
        assert np.array_equal(back, np.where(local[r] >= 0, ids, -1))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([1, 2, 4, 8]))
def test_hidden_shards_reassemble_to_the_checkpoint(seed, tp):
    dims, w = _table(seed, 96)
    e = embedding.table(dims, w)
    shards = [embedding.hidden_shard(e, t, tp) for t in range(tp)]
    assert all(s.shape == (96, dims.Hp // tp) and s.flags.c_contiguous for s in shards)
    back = embedding.table_inverse(dims, embedding.hidden_shards_inverse(shards))
    assert np.array_equal(_bits(back), _bits(w))
    # lane t*Hp/tp + j of a row is padded-HF hidden index sigma of that lane
    sig = hidden.sigma(dims.Hp)
    t, j = tp - 1, 5
    lane = t * dims.Hp // tp + j
    want = w[:, sig[lane]] if sig[lane] < dims.H else np.zeros(96, BF)
    assert np.array_equal(_bits(shards[t][:, j]), _bits(want))


def test_shards_of_row_blocks_are_blocks_of_shards():
    """The emitter lays out the table a row block at a time: that must give the same bytes."""
    dims, w = _table(3, 1000)
    e = embedding.table(dims, w)
    blocks = [embedding.table(dims, w[r0:r0 + 96]) for r0 in range(0, 1000, 96)]
    assert np.array_equal(_bits(np.concatenate(blocks)), _bits(e))
    for t in (0, 7):
        cut = np.concatenate([embedding.hidden_shard(b, t, 8) for b in blocks])
        assert np.array_equal(_bits(cut), _bits(embedding.hidden_shard(e, t, 8)))
