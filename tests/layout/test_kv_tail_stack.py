import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gkbuild.layout import kv, stack, tail, topology
from gkbuild.layout.dims import Dims
from gkbuild.model import preset


def _layout(packed=True, nb=5, kvh=2, block=4, d=3, item=1, L=36, form="paired"):
    return kv.KvLayout(form=form, num_layers=L, num_blocks=nb, kv_heads=kvh, block_size=block, head_dim=d,
                       dtype="fp8_e4m3", itemsize=item, packed=packed)


def test_120b_kv_numbers_in_both_forms():
    pb = _layout(nb=29127, kvh=1, block=128, d=64, L=36)  # paired: an entry a layer pair
    assert pb.entries == 18 and pb.bytes_per_rank == 18 * 2 * 29127 * 8192
    assert pb.k_block_shape == [29127, 1, 64, 64, 2] and pb.allocation_shape == [18, 29127, 1, 128, 64]
    assert pb.allocations == 2 and pb.update_indices == ("full", "swa")
    dma = pb.dma_check()
    assert dma["fits"] and dma["max_num_blocks"] == 29127 == 2**32 // (18 * 8192)
    assert dma["max_num_blocks_stacked"] == 2**32 // (36 * 8192) and dma["max_num_blocks_paired"] == 29127
    assert not _layout(nb=29128, kvh=1, block=128, d=64, L=36).dma_check()["fits"]
    regions = pb.di_regions()
    assert len(regions) == 36 and regions[0]["block_len"] == 8192 and regions[0]["layers"] == [0, 1]
    assert regions[1] == {"entry": 0, "half": "V", "tensor": "V_cache", "offset": 0, "block_len": 8192,
                          "count": 29127, "layers": [0, 1]}
    assert regions[2]["offset"] == 29127 * 8192 and regions[2]["tensor"] == "K_cache"
    assert [x["entry"] for x in pb.layers()][:4] == [0, 0, 1, 1]
    assert [(x["block_table"], x["update_index"]) for x in pb.layers()][:2] == [("swa", "swa"), ("full", "full")]
    seed = pb.describe()["per_buffer_allocation"]  # seed 000's runtime view: described, never an argument
    assert seed["buffers"] == 18 and seed["buffer_shape"] == [2, 29127, 1, 128, 64]
    st = _layout(nb=14563, kvh=1, block=128, d=64, L=36, form="stacked")
    assert st.entries == 36 and st.allocation_shape == [36, 14563, 1, 128, 64] and st.allocations == 2
    assert st.max_num_blocks() == 14563 and st.dma_check()["fits"]  # 2^32 / (36 x 8192)
    assert not _layout(nb=14564, kvh=1, block=128, d=64, L=36, form="stacked").dma_check()["fits"]
    assert [x["entry"] for x in st.layers()][:3] == [0, 1, 2] and st.update_indices == ("full",)
    regions = st.di_regions()
    assert len(regions) == 72 and regions[2] == {"entry": 1, "half": "K", "tensor": "K_cache", "offset": 14563 * 8192,
                                                 "block_len": 8192, "count": 14563, "layers": [1]}


@pytest.mark.parametrize("form", ["stacked", "paired"])
@pytest.mark.parametrize("packed", [True, False])
def test_offsets_match_the_real_buffer_bytes(packed, form):
    """k_offset / v_offset name the byte write_k and a V store touch, in either form's allocation."""
    lay = _layout(packed=packed, form=form, L=4)
    rng = np.random.default_rng(0)
    for _ in range(30):
        e, b, t = rng.integers(lay.entries), rng.integers(lay.num_blocks), rng.integers(lay.block_size)
        vec = rng.integers(1, 255, (lay.kv_heads, lay.head_dim), dtype=np.uint8)
        k_alloc, v_alloc = np.zeros(lay.allocation_shape, np.uint8), np.zeros(lay.allocation_shape, np.uint8)
        k_entry = k_alloc.reshape([lay.entries] + lay.k_block_shape)[e] if packed else k_alloc[e]
        v_entry = v_alloc[e]
        kv.write_k(k_entry, b, t, vec, packed)
        flat = k_alloc.reshape(-1)
        for h in range(lay.kv_heads):
            for c in range(lay.head_dim):
                assert flat[lay.k_offset(e, b, h, t, c)] == vec[h, c]
        assert np.count_nonzero(flat) == np.count_nonzero(vec)
        assert np.array_equal(kv.read_k(k_entry, b, t, packed), vec)
        v_entry[b, :, t, :] = vec  # V is never packed
        for h in range(lay.kv_heads):
            assert v_alloc.reshape(-1)[lay.v_offset(e, b, h, t, 0)] == vec[h, 0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.sampled_from([2, 4, 8, 128]), st.integers(1, 16), st.integers(0, 2**31))
def test_pack_block_roundtrip(kvh, block, d, seed):
    k = np.random.default_rng(seed).integers(0, 256, (kvh, block, d), dtype=np.uint8)
    p = kv.pack_block(k)
    assert p.shape == (kvh, block // 2, d, 2)
    assert np.array_equal(p[:, :, :, 0], k[:, 0::2, :]) and np.array_equal(p[:, :, :, 1], k[:, 1::2, :])
    assert np.array_equal(kv.unpack_block(p), k)


def test_budget():
    assert kv.budget_blocks(100, 10_000, 1_000, 500, "r") == 90
    with pytest.raises(Exception, match="KV budget does not fit: .* and a 0.00 GiB device reserve"):
        kv.budget_blocks(100, 1_000, 1_000, 500, "r")


# -- tail ownership: a numpy oracle that runs the all-to-all hop by hop ------------------------
def _oracle(vtp, gbs, hops, groups=1):
    """Each rank starts with every row (tagged by row id) of its vocab slice; run each hop's
    exchange literally; return the row ids each rank ends with, in receive order."""
    if groups > 1:  # one single-hop exchange per batch group of gbs/G rows
        per = gbs // groups
        parts = [_oracle(vtp, per, hops) for _ in range(groups)]
        return [[g * per + r for g, p in enumerate(parts) for r in p[rank]] for rank in range(vtp)]
    held = [list(range(gbs)) for _ in range(vtp)]
    for mesh in tail.compose_hops(vtp, hops):
        new = [None] * vtp
        for group in mesh:
            n = len(group)
            for pos, rank in enumerate(group):
                rows = held[rank]
                chunk = len(rows) // n
                assert all(held[m] == rows for m in group)  # the group agrees on the rows it holds
                new[rank] = rows[pos * chunk:(pos + 1) * chunk]
        held = new
    return held


@pytest.mark.parametrize("vtp, gbs, hops, groups", [
    (128, 128, (8, 16), 1), (128, 256, (8, 16), 1), (128, 256, (16, 8), 1), (128, 512, (2, 4, 16), 1),
    (8, 32, (8,), 1), (8, 32, (2, 4), 1), (8, 64, (8,), 2), (8, 64, (8,), 4), (1, 4, (1,), 1)])
def test_owned_rows_match_the_oracle(vtp, gbs, hops, groups):
    want = _oracle(vtp, gbs, hops, groups)
    got = [tail.owned_rows(r, vtp, gbs, hops, groups) for r in range(vtp)]
    assert got == want
    assert sorted(x for rows in got for x in rows) == list(range(gbs))  # a partition of the batch
    if groups == 1:
        for r in range(vtp):
            start, n = tail.owned_row_block(r, vtp, gbs, hops)
            assert got[r] == list(range(start, start + n))


def test_compose_hops_8x16():
    m = tail.compose_hops(128, (8, 16))
    assert len(m) == 2
    assert m[0][0] == tuple(range(8)) and m[0][1] == tuple(range(8, 16)) and len(m[0]) == 16
    assert m[1][0] == tuple(range(0, 128, 8)) and m[1][7] == tuple(range(7, 128, 8)) and len(m[1]) == 8
    with pytest.raises(ValueError):
        tail.compose_hops(128, (8, 8))


def test_lm_head_roundtrip_and_reader():
    import ml_dtypes

    rng = np.random.default_rng(3)
    dims = Dims.of(preset("tiny"), vtp=4)
    w = rng.standard_normal((dims.V, dims.H)).astype(ml_dtypes.bfloat16)
    shards = [tail.lm_head_t(dims, v, w) for v in range(4)]
    assert shards[0].shape == (dims.Hp, dims.V // 4) and shards[0].flags.c_contiguous
    assert np.array_equal(tail.lm_head_t_inverse(dims, shards).view(np.uint16), w.view(np.uint16))
    assert np.array_equal(tail.lm_head_t(dims, 1, w[dims.V_s:2 * dims.V_s]).view(np.uint16), shards[1].view(np.uint16))
    x = rng.standard_normal((2, dims.H)).astype(np.float32)
    from gkbuild.layout import hidden

    xk = hidden.to_kernel(x, 1, dims.Hp)
    logits = np.concatenate([xk @ s.astype(np.float32) for s in shards], axis=1)
    np.testing.assert_allclose(logits, x @ w.astype(np.float32).T, rtol=1e-4, atol=1e-3)


def test_meshes():
    assert topology.tp_mesh(8, 2) == (tuple(range(8)), tuple(range(8, 16)))
    assert topology.ep_mesh(4) == ((0, 1, 2, 3),)
    c = topology.coords(77, 8, 128)
    assert (c.dp, c.tp, c.ep, c.vtp) == (9, 5, 77, 77)


def test_stack_roundtrip():
    layers = [np.full((2, 3), i, np.float32) for i in range(4)]
    s = stack.stack(layers)
    assert s.shape == (4, 2, 3)
    assert all(np.array_equal(a, b) for a, b in zip(stack.unstack(s, 4), layers))
    shared = stack.unstack(s[:1], 4)
    assert all(np.array_equal(a, layers[0]) for a in shared)
    with pytest.raises(ValueError):
        stack.stack([np.zeros(2), np.zeros(3)])
