"""Pieces of the twins against independent references: transformers' RoPE, our MX decode, the host's
embedding rows."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from gkbuild.checkpoint import mxfp4
from gkbuild.kernels import decode, kernel_inputs, mx, rope
from gkbuild.kernels.collectives import Emulator
from gkbuild.layout import embedding, experts_mx, hidden, topology
from gkbuild.layout.dims import Dims
from gkbuild.model import preset


def _rope_params(cfg):
    r = cfg.rope
    return {"theta": r.theta, "factor": r.factor, "beta_fast": r.beta_fast, "beta_slow": r.beta_slow,
            "original_max_position_embeddings": r.original_max_position_embeddings, "truncate": r.truncate,
            "concentration": r.concentration}


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b"])
def test_yarn_tables_match_transformers(name):
    """Both RoPE forms against transformers' GptOssRotaryEmbedding: the host's cos/sin, and the fused
    form's inv_freq [d/2, 1] fp32 (bit-equal to transformers' frequencies) and concentration, on
    positions up to 131,072."""
    from transformers import GptOssConfig as HF
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    cfg = preset(name)
    hf = HF(**{k: v for k, v in cfg.to_hf().items() if k not in ("quantization_config",)})
    emb = GptOssRotaryEmbedding(hf)
    r = _rope_params(cfg)
    column = rope.inv_freq(cfg.d, r)[:, None]
    assert column.shape == (cfg.d // 2, 1) and column.dtype == torch.float32
    assert torch.equal(column[:, 0], emb.inv_freq)
    assert emb.attention_scaling == pytest.approx(r["concentration"], abs=0)
    pos = torch.cat([torch.tensor([0, 1, 7, 128, 4095, 4096, 70000]), torch.arange(0, 131073, 4099),
                     torch.tensor([131071, 131072])])[None]
    cos_hf, sin_hf = emb(torch.zeros(1, dtype=torch.float32), pos)
    for cos, sin in (rope.tables(pos[0], cfg.d, r), rope.fused_tables(pos[0], column, r["concentration"])):
        torch.testing.assert_close(cos, cos_hf[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin, sin_hf[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", ["vocab", "hidden"])
def test_fused_embedding_gives_the_host_rows_exactly(placement):
    """The prologue's gather and collectives over an emulated TP4 x DP2 world, fed what the runtime
    hands the kernel (``kernel_inputs.embed_ids``: the DP replica's tokens, TP-local ids for vocab,
    the rank's rows for hidden), give every rank the rows a runtime would gather from the whole
    table, bit for bit."""
    tp, dp, V = 4, 2, 1003
    world = tp * dp
    d = Dims.of(dataclasses.replace(preset("tiny"), vocab_size=V), tp=tp)
    w = torch.randn(V, d.H).to(torch.bfloat16)
    table = embedding.table(d, w.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    tokens = torch.tensor([0, 5, 1002, 77, 77, 500, 251, 1001, 3, 999, 250, 126, 127, 128, 4, 6])  # B = 16
    B, t_shard, b_attn = len(tokens), len(tokens) // world, len(tokens) // dp
    spec = {"placement": placement, "rows_per_rank": embedding.vocab_rows(V, tp)}

    def rank_fn(r, comm):
        shard = (embedding.vocab_shard if placement == "vocab" else embedding.hidden_shard)(table, r % tp, tp)
        ids, rows = kernel_inputs.embed_ids(spec, tokens, r, tp, dp)
        assert ids.dtype == np.int32 and ids.shape == (b_attn,)
        weight = torch.from_numpy(shard.view(np.int16)).view(torch.bfloat16)
        return decode.embed(weight, torch.from_numpy(ids).long(), placement, comm,
                            None if rows is None else torch.from_numpy(rows).long())

    em = Emulator({"tp": topology.tp_mesh(tp, dp), "ep": topology.ep_mesh(world)})
    got = em.run(rank_fn)
    full = torch.from_numpy(table.view(np.int16)).view(torch.bfloat16).float()
    for r in range(world):
        assert torch.equal(got[r], full[tokens[r * t_shard:(r + 1) * t_shard]]), r
    assert B == world * t_shard


def _random_mx(experts: int, seed: int):
    """(dims, HF gate_up blocks, scales, down blocks, scales) of random MXFP4 experts at widths that pad."""
    rng = np.random.default_rng(seed)
    d = Dims.of(dataclasses.replace(preset("tiny"), hidden_size=448, intermediate_size=960))
    return (d, rng.integers(0, 256, (experts, 2 * d.I, d.H // 32, 16), dtype=np.uint8),
            rng.integers(118, 125, (experts, 2 * d.I, d.H // 32), dtype=np.uint8),
            rng.integers(0, 256, (experts, d.H, d.I // 32, 16), dtype=np.uint8),
            rng.integers(118, 125, (experts, d.H, d.I // 32), dtype=np.uint8))


def test_mx_reader_agrees_with_the_checkpoint_decode():
    """The twin's reader of the tiles and mxfp4.decode of the HF bytes give the same matrices."""
    d, gb, gs, db, ds = _random_mx(1, 0)
    W, S, _ = experts_mx.gate_up(d, gb, gs, np.zeros((1, 2 * d.I), np.float32))
    dense = mx.gate_up(torch.from_numpy(W[0].view(np.int16)).view(torch.uint16), torch.from_numpy(S[0]))
    ref = mxfp4.decode(gb[0], gs[0])  # [2I (interleaved), H]
    pi = experts_mx.pi(d.Ip, d.P_I)
    for g in (0, 1):
        for j in range(0, d.Ip, 37):
            i = pi[j]
            col = dense[g, :, j].numpy()
            want = ref[2 * i + g] if i < d.I else np.zeros(d.H, np.float32)
            np.testing.assert_array_equal(col[:d.H], want)
            assert not col[d.H:].any()
    Wd, Sd, _ = experts_mx.down(d, db, ds, np.zeros((1, d.H), np.float32))
    dd = mx.down(torch.from_numpy(Wd[0].view(np.int16)).view(torch.uint16), torch.from_numpy(Sd[0])).numpy()
    refd = mxfp4.decode(db[0], ds[0])  # [H, I]
    sig = hidden.sigma(d.Hp)
    for j in range(0, d.Ip, 41):
        i = pi[j]
        for x in range(0, d.Hp, 29):
            want = refd[sig[x], i] if (sig[x] < d.H and i < d.I) else 0.0
            assert dd[j, x] == want


def test_the_table_driven_readers_are_the_traced_readers_transposed():
    """Eager verify reads every expert through mx's u16 table (rows of the transposed weights);
    the traced programs through nibble lookups. The same tiles give the same numbers."""
    d, gb, gs, db, ds = _random_mx(2, 1)
    W, S, _ = experts_mx.gate_up(d, gb, gs, np.zeros((2, 2 * d.I), np.float32))
    Wd, Sd, _ = experts_mx.down(d, db, ds, np.zeros((2, d.H), np.float32))
    u16 = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.uint16)  # noqa: E731
    for e in range(2):
        assert torch.equal(mx.gate_up_rows(u16(W[e]), torch.from_numpy(S[e])),
                           mx.gate_up(u16(W[e]), torch.from_numpy(S[e])).transpose(-1, -2))
        rows = mx.down_rows(u16(Wd[e]), torch.from_numpy(Sd[e]))
        traced = mx.down(u16(Wd[e]), torch.from_numpy(Sd[e]))  # [Ip (column j), Hp]
        assert torch.equal(rows, traced[mx.down_columns(d.Ip, d.P_I)].T)
    # a leading expert axis reads as each expert alone
    assert torch.equal(mx.gate_up_rows(u16(W), torch.from_numpy(S))[1], mx.gate_up_rows(u16(W[1]), torch.from_numpy(S[1])))
    assert sorted(mx.down_columns(d.Ip, d.P_I).tolist()) == list(range(d.Ip))


def test_expert_forward_on_rows_is_the_traced_all_expert_form():
    """decode.experts' eager path (rows form, probes) against its traced einsum form."""
    cfg = dataclasses.replace(preset("tiny"), hidden_size=448, intermediate_size=960)
    d = Dims.of(cfg)
    rng = np.random.default_rng(2)
    W, S, B = experts_mx.gate_up(d, rng.integers(0, 256, (8, 2 * d.I, d.H // 32, 16), dtype=np.uint8),
                                 rng.integers(120, 124, (8, 2 * d.I, d.H // 32), dtype=np.uint8),
                                 rng.normal(0, 0.1, (8, 2 * d.I)).astype(np.float32))
    Wd, Sd, Bd = experts_mx.down(d, rng.integers(0, 256, (8, d.H, d.I // 32, 16), dtype=np.uint8),
                                 rng.integers(120, 124, (8, d.H, d.I // 32), dtype=np.uint8),
                                 rng.normal(0, 0.1, (8, d.H)).astype(np.float32))
    u16 = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.uint16)  # noqa: E731
    t = {"expert_gate_up_weights": u16(W)[None], "expert_gate_up_weights_scale": torch.from_numpy(S)[None],
         "expert_gate_up_bias": torch.from_numpy(B)[None], "expert_down_weights": u16(Wd)[None],
         "expert_down_weights_scale": torch.from_numpy(Sd)[None], "expert_down_bias": torch.from_numpy(Bd)[None],
         "router_weights": torch.from_numpy(rng.normal(0, 1, (1, d.Hp, 8)).astype(np.float32)),
         "router_bias": torch.zeros(1, 8)}
    sc = decode.Scalars(num_layers=1, eps=1e-5, hidden_actual=d.H, hidden_padded=d.Hp, top_k=4, softmax_scale=0.125,
                        gate_clamp_upper_limit=7.0, up_clamp_upper_limit=8.0, up_clamp_lower_limit=-6.0, k_scale=None,
                        v_scale=None, kv_dtype="bf16", packed=False, block_size=4, experts="mxfp4", ep_rank=0,
                        experts_per_rank=8)
    x = torch.from_numpy(rng.normal(0, 1, (5, d.Hp)).astype(np.float32)) * torch.from_numpy(~hidden.pad_lanes(d.H, d.Hp))
    probe = decode.Probe(x[:2].clone())
    eager = decode.experts(t, 0, x, sc, probe=probe)
    gu, gu_b, down, down_b = decode.expert_weights(t, 0, sc)
    xs = x[:, torch.from_numpy(hidden.sigma(d.Hp)).argsort()]
    h = decode._swiglu(torch.einsum("bh,ehj->ebj", xs, gu[:, 0]) + gu_b[:, 0, None],
                       torch.einsum("bh,ehj->ebj", xs, gu[:, 1]) + gu_b[:, 1, None], sc)
    every = torch.einsum("ebj,ejx->ebx", h, down) + down_b[:, None]  # [E, B, Hp]: every expert, every row
    logits = x @ t["router_weights"][0] + t["router_bias"][0]
    idx, w = decode.route(logits, 4)
    want = (torch.zeros(5, 8).scatter(1, idx, w).T[..., None] * every).sum(0)
    torch.testing.assert_close(eager, want, rtol=1e-4, atol=1e-4)
    assert sorted(probe.out) == list(range(8))
    torch.testing.assert_close(torch.stack([probe.out[e] for e in range(8)]), every[:, :2], rtol=1e-4, atol=1e-4)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)  # NaNs, infinities and -0 compared as they are


def _every_byte_at_every_scale(rng, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """[blocks, 8] u16 + [blocks] u8: at each of the 256 scales, every byte value as a u16's low byte
    and as its high byte (32 blocks a scale), then the blocks in a random order."""
    lo = np.concatenate([rng.permutation(256) for _ in range(256)]).astype(np.uint16)
    hi = np.concatenate([rng.permutation(256) for _ in range(256)]).astype(np.uint16)
    w = (lo | hi << 8).reshape(256 * 32, 8)
    s = np.repeat(np.arange(256, dtype=np.uint8), 32)
    order = rng.permutation(len(s))
    assert blocks == len(s)
    return w[order], s[order]


@pytest.mark.parametrize("scales", ["every", "extreme"])
def test_the_byte_table_readers_are_the_traced_readers_on_every_byte_and_scale(scales):
    """The eager readers look a tile byte up with its block's scale in one table (``mx._pairs``,
    ``mxpairs``); the traced readers decode four nibbles and multiply by exp2(scale - 127), as the
    eager readers did before (a u16 table, then the scale). Every byte value at every scale (0:
    subnormal products; 254: infinite ones; 255: inf and NaN), then random tiles at extreme scales:
    the same bits, transposed."""
    rng = np.random.default_rng(7)
    u16 = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.uint16)  # noqa: E731
    G, nht, Ip, P = 2, 2, 128, 128  # gate_up: [g, j, ht, block] = 8192 blocks of 8 x4 rows
    if scales == "every":
        w, s = _every_byte_at_every_scale(rng, G * Ip * nht * P // 8)
    else:
        w = rng.integers(0, 1 << 16, (G * Ip * nht * P // 8, 8), dtype=np.uint16)
        s = rng.choice(np.array([0, 1, 2, 126, 127, 128, 252, 253, 254, 255], np.uint8), len(w))
    # the rows' [g, j, ht, p] order back to the tile's [p, g, ht, j]
    W = u16(w.reshape(G, Ip, nht, P).transpose(3, 0, 2, 1))
    S = torch.from_numpy(np.ascontiguousarray(s.reshape(G, Ip, nht, P // 8).transpose(3, 0, 2, 1)))
    rows = mx.gate_up_rows(W, S)
    assert torch.isnan(rows).any()  # scale 255
    assert torch.equal(_bits(rows), _bits(mx.gate_up(W, S).transpose(-1, -2)))
    nit, Hp = 4, 128  # down: [x, it, block]: the same 8192 blocks
    Wd = u16(w.reshape(Hp, nit, P).transpose(2, 1, 0))
    Sd = torch.from_numpy(np.ascontiguousarray(s.reshape(Hp, nit, P // 8).transpose(2, 1, 0)))
    traced = mx.down(Wd, Sd)[mx.down_columns(nit * 4 * P, P)].T
    assert torch.equal(_bits(mx.down_rows(Wd, Sd)), _bits(traced))
    assert torch.isinf(traced).any() and (traced.abs() < 2.0 ** -126).logical_and(traced != 0).any()


def test_the_device_lookup_is_the_cpu_lookup():
    """mx's table lookup takes torch's indexing on a GPU (no numpy there): the same values."""
    rng = np.random.default_rng(3)
    u = torch.from_numpy(rng.integers(0, 1 << 16, (7, 33, 8), dtype=np.uint16).view(np.int16)).view(torch.uint16)
    s = torch.from_numpy(rng.integers(0, 256, (7, 33), dtype=np.uint8))
    assert torch.equal(_bits(mx._take(u, s, numpy=False)), _bits(mx._take(u, s, numpy=True)))
    assert torch.equal(_bits(mx._take(u.transpose(0, 1), s.T, numpy=False)), _bits(mx._take(u, s).transpose(0, 1)))