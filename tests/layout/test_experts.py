"""MX and bf16 expert layouts: round trips, the contract's index rules, and an end-to-end check
through a reader that follows nki-library's MoE twin (mlp_proj_mxfp4_torch) indexing."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gkbuild.checkpoint import mxfp4
from gkbuild.layout import experts_bf16, experts_mx, hidden, scalars
from gkbuild.layout.dims import Dims
from gkbuild.model import preset

BF = ml_dtypes.bfloat16
LIMIT = 7.0


def _dims(H=960, I=960, E=4):  # noqa: E741
    return Dims.of(dataclasses.replace(preset("tiny"), hidden_size=H, intermediate_size=I, num_local_experts=E))


def _hf_experts(rng, d: Dims, E_L: int):
    gu_b = rng.integers(0, 256, (E_L, 2 * d.I, d.H // 32, 16), dtype=np.uint8)
    gu_s = rng.integers(118, 125, (E_L, 2 * d.I, d.H // 32), dtype=np.uint8)
    dn_b = rng.integers(0, 256, (E_L, d.H, d.I // 32, 16), dtype=np.uint8)
    dn_s = rng.integers(118, 125, (E_L, d.H, d.I // 32), dtype=np.uint8)
    mag = rng.uniform(2.0 ** -8, 2.0 ** 3, (E_L, 2 * d.I)) * rng.choice([-1, 1], (E_L, 2 * d.I))
    gu_bias = mag.astype(BF)
    dn_bias = (rng.uniform(-1, 1, (E_L, d.H))).astype(BF)
    return gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias


def _same(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([(960, 960), (448, 448), (2880, 544), (96, 1056)]), st.integers(1, 2), st.integers(0, 2**31))
def test_mx_roundtrip(sizes, E_L, seed):
    d = _dims(*sizes)
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = _hf_experts(np.random.default_rng(seed), d, E_L)
    W, S, B = experts_mx.gate_up(d, gu_b, gu_s, gu_bias)
    nht, nit = d.Hp // 512, d.Ip // 512
    assert W.shape == (E_L, 128, 2, nht, d.Ip) and W.dtype == np.uint16
    assert S.shape == (E_L, 16, 2, nht, d.Ip) and S.dtype == np.uint8
    assert B.shape == (E_L, d.P_I, 2, nit, 4) and B.dtype == np.float32
    back = experts_mx.gate_up_inverse(d, W, S, B, BF)
    assert _same(back[0], gu_b) and _same(back[1], gu_s) and _same(back[2], gu_bias)
    W, S, B = experts_mx.down(d, dn_b, dn_s, dn_bias)
    assert W.shape == (E_L, d.P_I, nit, d.Hp) and S.shape == (E_L, d.P_I // 8, nit, d.Hp) and B.shape == (E_L, d.Hp)
    back = experts_mx.down_inverse(d, W, S, B, BF)
    assert _same(back[0], dn_b) and _same(back[1], dn_s) and _same(back[2], dn_bias)


def test_mx_contract_index_rules():
    """CONTRACT.md 2a, entry by entry, with pi and sigma written out here."""
    rng = np.random.default_rng(5)
    d = _dims()
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = _hf_experts(rng, d, 1)
    W, S, B = experts_mx.gate_up(d, gu_b, gu_s, gu_bias)
    Wd, Sd, Bd = experts_mx.down(d, dn_b, dn_s, dn_bias)
    P_I = min(128, d.Ip // 4)

    def pi(j):
        it, w, m = j // 512, (j % 512) // P_I, j % P_I
        return 512 * it + 4 * m + w

    def sig(x):
        return 4 * (x % (d.Hp // 4)) + x // (d.Hp // 4)

    def U(blocks, row, c):  # bytes 2c, 2c+1 of the (padded) row, little-endian
        flat = blocks[row].reshape(-1) if row < blocks.shape[0] else None
        if flat is None or 2 * c >= flat.size:
            return 0
        return int(flat[2 * c]) | int(flat[2 * c + 1]) << 8

    def scale(sc, row, s):
        return int(sc[row, s]) if row < sc.shape[0] and s < sc.shape[1] else 0

    for _ in range(400):
        p, g, ht, j = rng.integers(128), rng.integers(2), rng.integers(d.Hp // 512), rng.integers(d.Ip)
        assert W[0, p, g, ht, j] == U(gu_b[0], 2 * pi(j) + g, 128 * ht + p)
        s = rng.integers(16)
        assert S[0, s, g, ht, j] == scale(gu_s[0], 2 * pi(j) + g, 16 * ht + s)
        m, it, w = rng.integers(P_I), rng.integers(d.Ip // 512), rng.integers(4)
        i = 512 * it + 4 * m + w
        want = float(gu_bias[0, 2 * i + g]) + (1.0 if (g == 1) else 0.0) if i < d.I else 0.0
        assert B[0, m, g, it, w] == np.float32(want)
        x = rng.integers(d.Hp)
        assert Wd[0, p, it, x] == (U(dn_b[0], sig(x), 128 * it + p) if sig(x) < d.H else 0)
        assert Sd[0, s, it, x] == (scale(dn_s[0], sig(x), 16 * it + s) if sig(x) < d.H else 0)
        assert Bd[0, x] == (np.float32(dn_bias[0, sig(x)]) if sig(x) < d.H else 0)


def _unpack_x4(u16: np.ndarray) -> np.ndarray:
    """[P, F] u16 -> [P, F, 4] e2m1 values, nibble n of the u16 as element n (the twin's unpack)."""
    n = np.stack([(u16 >> (4 * k)) & 0xF for k in range(4)], axis=-1)
    return mxfp4.E2M1[n]


def _twin_gate_up(W, S, B, h_hf):
    """gate_up_proj_mxfp4_torch_ref's indexing: one expert, one of gate/up, activation [Hp] in
    padded-HF order (the x4 elements the kernel feeds). Returns the tile [128, n_I512, 4]."""
    nht, Ip = W.shape[1], W.shape[2]
    w = _unpack_x4(W.transpose(1, 0, 2).reshape(nht * 128, Ip))  # [Hp/4, Ip, 4]
    sc = 2.0 ** (S.transpose(1, 0, 2).reshape(nht * 16, Ip).astype(np.float64) - 127)
    sc = np.repeat(sc, 8, axis=0)[:, :, None]  # one scale per 8 x4 rows (32 elements)
    result = np.einsum("kiq,kq->i", w * sc, h_hf.reshape(-1, 4))
    tile = result.reshape(Ip // 512, 4, 128).transpose(2, 0, 1)  # out[p, i, w] = result[512 i + 128 w + p]
    return tile + B


def _twin_down(W, S, B, inter):
    """down_proj_mxfp4_torch_ref's indexing (activation kept in fp32, not MX-quantized):
    inter tile [P_I, n_I512, 4] -> [Hp] kernel lanes."""
    P_I, nit, Hp = W.shape
    a = inter.transpose(1, 0, 2).reshape(nit * P_I, 4)  # row it*P_I + p
    w = _unpack_x4(W.transpose(1, 0, 2).reshape(nit * P_I, Hp))  # [rows, Hp, 4]
    sc = np.repeat(2.0 ** (S.transpose(1, 0, 2).reshape(-1, Hp).astype(np.float64) - 127), 8, axis=0)
    return np.einsum("kq,kxq->x", a, w * sc[:, :, None]) + B


def _swiglu_folded(g, u):
    g = np.minimum(g, LIMIT)
    u = np.clip(u, -LIMIT + 1, LIMIT + 1)  # +1 already in the up bias
    return g / (1 + np.exp(-1.702 * g)) * u


def _hf_expert(gu_w, gu_bias, dn_w, dn_bias, x):
    gu = gu_w @ x + gu_bias  # interleaved rows
    g, u = np.minimum(gu[0::2], LIMIT), np.clip(gu[1::2], -LIMIT, LIMIT)
    return dn_w @ (g / (1 + np.exp(-1.702 * g)) * (u + 1)) + dn_bias


@pytest.mark.parametrize("sizes", [(960, 960), (448, 1056)])
def test_mx_kernel_reader_end_to_end_matches_hf(sizes):
    rng = np.random.default_rng(7)
    d = _dims(*sizes)
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = _hf_experts(rng, d, 1)
    W, S, B = experts_mx.gate_up(d, gu_b, gu_s, gu_bias)
    Wd, Sd, Bd = experts_mx.down(d, dn_b, dn_s, dn_bias)
    x = rng.standard_normal(d.H)
    x_hf_padded = hidden.pad(x, 0, d.Hp)
    gate = _twin_gate_up(W[0, :, 0], S[0, :, 0], B[0, :, 0], x_hf_padded)
    up = _twin_gate_up(W[0, :, 1], S[0, :, 1], B[0, :, 1], x_hf_padded)
    out_lanes = _twin_down(Wd[0], Sd[0], Bd[0], _swiglu_folded(gate, up))
    hf = _hf_expert(mxfp4.decode(gu_b[0], gu_s[0]).astype(np.float64), gu_bias[0].astype(np.float64),
                    mxfp4.decode(dn_b[0], dn_s[0]).astype(np.float64), dn_bias[0].astype(np.float64), x)
    assert not np.any(out_lanes[hidden.pad_lanes(d.H, d.Hp)])
    np.testing.assert_allclose(hidden.from_kernel(out_lanes, 0, d.H), hf, rtol=1e-9, atol=1e-9)


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([(960, 960), (448, 1056)]), st.integers(1, 2), st.integers(0, 2**31))
def test_bf16_roundtrip_and_reader(sizes, E_L, seed):
    rng = np.random.default_rng(seed)
    d = _dims(*sizes)
    gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias = _hf_experts(rng, d, E_L)
    gu_w, dn_w = mxfp4.decode(gu_b, gu_s), mxfp4.decode(dn_b, dn_s)
    W, B = experts_bf16.gate_up(d, gu_w, gu_bias)
    D, Bd = experts_bf16.down(d, dn_w, dn_bias)
    assert W.shape == (E_L, d.Hp, 2, d.Ip) and B.shape == (E_L, 2, d.Ip) and D.shape == (E_L, d.Ip, d.Hp)
    w2, b2 = experts_bf16.gate_up_inverse(d, W, B, BF)
    assert _same(w2, gu_w.astype(BF)) and np.array_equal(w2.astype(np.float32), gu_w)  # exact in bf16
    assert _same(b2, gu_bias)
    d2, bd2 = experts_bf16.down_inverse(d, D, Bd, BF)
    assert np.array_equal(d2.astype(np.float32), dn_w) and _same(bd2, dn_bias)
    # the bf16 MoE path's reading: gate/up = x_lanes @ W[:, g, :] + B[g]; down = act @ D + bias
    x = rng.standard_normal(d.H)
    xk = hidden.to_kernel(x, 0, d.Hp)
    f = lambda a: a.astype(np.float64)  # noqa: E731
    act = _swiglu_folded(xk @ f(W[0, :, 0]) + B[0, 0], xk @ f(W[0, :, 1]) + B[0, 1])
    out = hidden.from_kernel(act @ f(D[0]) + Bd[0], 0, d.H)
    np.testing.assert_allclose(out, _hf_expert(f(gu_w[0]), f(gu_bias[0]), f(dn_w[0]), f(dn_bias[0]), x),
                               rtol=1e-9, atol=1e-9)


def test_clamps_shift_with_the_folded_bias():
    assert scalars.clamps(7.0) == {"gate_clamp_upper_limit": 7.0, "up_clamp_upper_limit": 8.0,
                                      "up_clamp_lower_limit": -6.0}
