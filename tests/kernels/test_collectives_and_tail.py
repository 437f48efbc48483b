import numpy as np
import pytest
import torch

from gkbuild.errors import GkError
from gkbuild.kernels import tail
from gkbuild.kernels.collectives import Emulator, Single
from gkbuild.layout.tail import compose_hops, owned_rows


def _emulator(world, tp=None, hops=None):
    groups = {"ep": [list(range(world))]}
    if tp:
        groups["tp"] = [list(range(d * tp, (d + 1) * tp)) for d in range(world // tp)]
    for i, mesh in enumerate(compose_hops(world, hops or (world,))):
        groups[("hop", i)] = mesh
    return Emulator(groups)


def test_collectives_match_a_numpy_oracle():
    world, tp = 8, 4
    em = _emulator(world, tp)
    data = [torch.arange(24, dtype=torch.float32).view(8, 3) + 100 * r for r in range(world)]

    def fn(r, comm):
        return (comm.all_gather(data[r], "tp"), comm.reduce_scatter(data[r], "tp"),
                comm.reduce_scatter(data[r], "ep"))

    out = em.run(fn)
    for r in range(world):
        group = [q for q in range(world) if q // tp == r // tp]
        pos = group.index(r)
        ag, rs, rs_ep = out[r]
        assert torch.equal(ag, torch.cat([data[q] for q in group]))
        assert torch.equal(rs, sum(data[q] for q in group)[pos * 2:(pos + 1) * 2])
        assert torch.equal(rs_ep, sum(data[q] for q in range(world))[r:r + 1])
    with pytest.raises(GkError, match="splits 8 rows over 3 members"):
        _emulator(3).run(lambda r, comm: comm.reduce_scatter(torch.zeros(8, 1), "ep"))


def test_all_to_all_hands_each_member_its_chunk():
    world = 4
    em = _emulator(world)
    data = [torch.full((4, 2), float(r)) + torch.arange(4.0)[:, None] * 100 for r in range(world)]
    out = em.run(lambda r, comm: comm.all_to_all(data[r], ("hop", 0)))
    for r in range(world):
        # member r gets row r of every sender, senders side by side
        assert torch.equal(out[r], torch.cat([data[s][r:r + 1] for s in range(world)], dim=1))


def test_an_error_on_one_rank_is_raised_and_a_skipped_collective_is_named():
    em = _emulator(4)
    with pytest.raises(ValueError, match="boom"):
        em.run(lambda r, comm: (_ for _ in ()).throw(ValueError("boom")) if r == 2 else comm.all_gather(
            torch.zeros(1), "ep"))
    with pytest.raises(GkError, match="deadlocked"):
        em.run(lambda r, comm: comm.all_gather(torch.zeros(1), "ep") if r != 1 else None)
    assert Single().all_gather(torch.ones(2), "tp").shape == (2,)


@pytest.mark.parametrize("vtp, gbs, hops", [(8, 16, (8,)), (8, 16, (2, 4)), (8, 16, (4, 2)), (16, 32, (2, 2, 4))])
def test_tail_rows_and_topk_match_a_numpy_oracle(vtp, gbs, hops):
    rng = np.random.default_rng(vtp + len(hops))
    V_s, H = 12, 64
    hidden = torch.from_numpy(rng.standard_normal((gbs, H)).astype(np.float32))
    gamma = torch.ones(1, H)
    shards = [torch.from_numpy(rng.standard_normal((H, V_s)).astype(np.float32)).to(torch.bfloat16)
              for _ in range(vtp)]
    k = 7
    em = _emulator(vtp, hops=hops)
    outs = em.run(lambda r, comm: tail.step(hidden, gamma, shards[r], comm, len(hops), k, 1e-5, H))
    # oracle: full logits in numpy (bf16 operands, fp32 accumulation, bf16 mirror for top-k)
    h = (hidden.numpy() / np.sqrt((hidden.numpy() ** 2).mean(1, keepdims=True) + 1e-5))
    h = torch.from_numpy(h).to(torch.bfloat16).to(torch.float32).numpy()
    full = np.concatenate([h @ s.to(torch.float32).numpy() for s in shards], axis=1)
    mirror = torch.from_numpy(full).to(torch.bfloat16).to(torch.float32).numpy()
    for r in range(vtp):
        rows = owned_rows(r, vtp, gbs, hops)
        order = np.argsort(-mirror[rows], axis=1, kind="stable")[:, :k]
        assert np.array_equal(outs[r].topk_indices.numpy(), order)
        assert np.allclose(outs[r].topk_values.numpy(), np.take_along_axis(mirror[rows], order, 1))
        np.testing.assert_allclose(outs[r].logits.numpy(), full[:, r * V_s:(r + 1) * V_s], rtol=1e-5, atol=1e-4)


def test_topk_is_stable_on_ties():
    v, i = tail.stable_topk(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]]), 3)
    assert i.tolist() == [[1, 2, 4]]


def test_sampler():
    values = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 5)
    idx = torch.tensor([[10, 11, 12, 13]] * 5)
    params = torch.tensor([
        [0, 1.0, 0.0, 0.9],     # greedy (temperature 0), u ignored
        [1, 1.0, 1.0, 0.99],    # top_k 1: only the best
        [0, 1.0, 1.0, 0.999],   # all four, u near 1: the last one
        [0, 0.5, 1.0, 0.999],   # top_p 0.5: softmax(4,3,2,1)[0] = 0.64 >= 0.5 -> only the first
        [4, 1.0, 1e6, 0.5],     # very high temperature: near uniform, u = 0.5 -> the second half starts
    ])
    got = tail.sample(values, idx, params).tolist()
    assert got[:4] == [10, 10, 13, 10]
    assert got[4] in (11, 12)
    p = torch.softmax(values[0], 0)
    # inverse transform: the first candidate whose cumulative mass exceeds u
    for u, want in ((0.1, 10), (float(p[0]) + 1e-3, 11), (float(p[:2].sum()) + 1e-3, 12)):
        assert tail.sample(values[:1], idx[:1], torch.tensor([[0, 1.0, 1.0, u]])).tolist() == [want]


@pytest.mark.slow
def test_batch_grouped_tail_at_the_production_geometry_puts_every_row_where_owned_rows_says():
    """vocab 201,088 over VTP 128, one hop, a2a_batch_groups 2, batch 256 (a geometry the kernel
    accepts): each rank's top-k, values and token are those of the rows owned_rows names, in its
    receive order (two per rank: row r and row 128 + r)."""
    from gkbuild.layout.tail import batch_groups_refusal

    vtp, gbs, groups, V, H, k = 128, 256, 2, 201088, 32, 256
    assert batch_groups_refusal(gbs, vtp, (vtp,), groups, V, k) is None
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(gbs, H, generator=g)
    w = (torch.randn(H, V, generator=g) * 0.3).to(torch.bfloat16)
    shards = list(w.split(V // vtp, dim=1))
    greedy = torch.zeros(gbs // vtp, 3)
    em = _emulator(vtp)
    outs = em.run(lambda r, comm: tail.step(hidden, torch.ones(1, H), shards[r], comm, 1, k, 1e-5, H, params=greedy,
                                            emit_logits=False, batch_groups=groups))
    mirror = tail.lm_head(hidden, torch.ones(1, H), w, 1e-5, H).to(torch.bfloat16).to(torch.float32)
    values, order = tail.stable_topk(mirror, k)
    for r in range(vtp):
        rows = owned_rows(r, vtp, gbs, (vtp,), groups)
        assert rows == [r, 128 + r]
        assert torch.equal(outs[r].topk_indices, order[rows]) and torch.equal(outs[r].topk_values, values[rows])
        assert outs[r].tokens.tolist() == order[rows, 0].tolist()


def test_a_sparse_reduce_scatter_is_the_dense_one_bit_for_bit():
    """verify's MoE hands the EP reduce-scatter only the rows a rank's experts add to."""
    world, n = 8, 16
    g = torch.Generator().manual_seed(0)
    rows = [torch.randperm(n, generator=g)[: r % 5] for r in range(world)]  # rank 0 adds nothing
    values = [torch.randn(len(rows[r]), 3, generator=g) for r in range(world)]
    dense = [torch.zeros(n, 3).index_put((rows[r],), values[r]) for r in range(world)]
    em = _emulator(world)
    sparse = em.run(lambda r, comm: comm.reduce_scatter_rows(rows[r], values[r], n, "ep"))
    full = em.run(lambda r, comm: comm.reduce_scatter(dense[r], "ep"))
    assert all(torch.equal(a, b) for a, b in zip(sparse, full))
    assert torch.equal(Single().reduce_scatter_rows(rows[3], values[3], n, "ep"), dense[3])
