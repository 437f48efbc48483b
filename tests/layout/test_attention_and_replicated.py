import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gkbuild.layout import attention, hidden, replicated
from gkbuild.layout.dims import Dims
from gkbuild.model import preset

BF = ml_dtypes.bfloat16


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _cfg(q, kv, d, H):
    return dataclasses.replace(preset("tiny"), num_attention_heads=q, num_key_value_heads=kv, head_dim=d,
                               hidden_size=H)


def _hf_attn(rng, q, kv, d, H):
    f = lambda *s: rng.standard_normal(s).astype(BF)  # noqa: E731
    return dict(q_w=f(q * d, H), k_w=f(kv * d, H), v_w=f(kv * d, H), q_b=f(q * d), k_b=f(kv * d),
                v_b=f(kv * d), o_w=f(H, q * d), sinks=f(q))


def _qkv(dims, t, w):
    """TP rank t's (W_qkv, bias_qkv) from only its heads' rows of q/k/v, as a build reads them."""
    (q0, q1), (k0, k1) = attention.heads(dims, t)
    r = lambda name, h0, h1: w[name][h0 * dims.d:h1 * dims.d]  # noqa: E731
    return (attention.qkv_weight(dims, r("q_w", q0, q1), r("k_w", k0, k1), r("v_w", k0, k1)),
            attention.qkv_bias(r("q_b", q0, q1), r("k_b", k0, k1), r("v_b", k0, k1)))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8), (64, 8, 8), (64, 8, 16), (4, 4, 2)]),
       st.integers(0, 2**31))
def test_qkv_out_sink_roundtrip(heads, seed):
    q, kv, tp = heads
    d, H = 4, 96
    rng = np.random.default_rng(seed)
    w = _hf_attn(rng, q, kv, d, H)
    dims = Dims.of(_cfg(q, kv, d, H), tp=tp)
    shards = [_qkv(dims, t, w) for t in range(tp)]
    for W, B in shards:
        assert W.shape == (dims.Hp, (dims.q_l + 2 * dims.kv_l) * d) and B.shape == (1, W.shape[1])
        assert W.flags.c_contiguous
        assert not np.any(_bits(W[hidden.pad_lanes(H, dims.Hp)]))
    back = attention.qkv_inverse(dims, shards)
    for got, name in zip(back, ("q_w", "k_w", "v_w", "q_b", "k_b", "v_b")):
        assert np.array_equal(_bits(got), _bits(w[name])), name
    outs = [attention.w_out(dims, t, w["o_w"]) for t in range(tp)]
    assert outs[0].shape == (dims.q_l * d, dims.Hp)
    assert np.array_equal(_bits(attention.w_out_inverse(dims, outs)), _bits(w["o_w"]))
    # a power-of-two v_scale folds exactly and unfolds exactly
    outs = [attention.w_out(dims, t, w["o_w"], v_scale=0.25) for t in range(tp)]
    assert np.array_equal(_bits(attention.w_out_inverse(dims, outs, v_scale=0.25)), _bits(w["o_w"]))
    sinks = [attention.sink(w["sinks"][slice(*attention.heads(dims, t)[0])]) for t in range(tp)]
    assert sinks[0].shape == (dims.q_l, 1)
    assert np.array_equal(_bits(attention.sink_inverse(sinks)), _bits(w["sinks"]))


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_o_bias_sums_back_over_tp(tp):
    rng = np.random.default_rng(tp)
    dims = Dims.of(preset("tiny-topology"), tp=tp)
    b = rng.standard_normal(dims.H).astype(BF)
    r = attention.o_bias(dims, b)
    assert r.shape == (1, dims.Hp) and r.dtype == BF
    assert np.array_equal(_bits(attention.o_bias_inverse(dims, r)), _bits(b))  # exact: tp is a power of 2
    # what the kernel does: every TP rank adds bias_out to its partial, the reduce-scatter sums them
    summed = sum(r.astype(np.float32) for _ in range(tp))
    np.testing.assert_array_equal(hidden.from_kernel(summed[0], 0, dims.H), b.astype(np.float32))


def test_replicated_kv_heads_must_agree():
    rng = np.random.default_rng(0)
    q, kv, d, H, tp = 8, 2, 4, 96, 4
    w = _hf_attn(rng, q, kv, d, H)
    dims = Dims.of(_cfg(q, kv, d, H), tp=tp)
    assert [dims.kv_heads_of(t) for t in range(tp)] == [[0], [0], [1], [1]]
    shards = [_qkv(dims, t, w) for t in range(tp)]
    W, B = shards[1]
    W = W.copy()
    W[0, q // tp * d] = BF(123.0)  # first K column of rank 1, a replica of kv head 0
    shards[1] = (W, B)
    with pytest.raises(ValueError, match="replicas of kv head 0 differ"):
        attention.qkv_inverse(dims, shards)


def test_kernel_reader_attention_matches_hf():
    """QKV as the nki twin reads it: X [B, H] (kernel lanes) @ W_qkv + bias; columns = q heads, k, v."""
    rng = np.random.default_rng(1)
    q, kv, d, H, tp = 8, 2, 8, 96, 2
    w = _hf_attn(rng, q, kv, d, H)
    dims = Dims.of(_cfg(q, kv, d, H), tp=tp)
    x = rng.standard_normal((3, H)).astype(np.float32)
    xk = hidden.to_kernel(x, 1, dims.Hp)
    f32 = lambda a: a.astype(np.float32)  # noqa: E731
    for t in range(tp):
        W, B = _qkv(dims, t, w)
        out = xk @ f32(W) + f32(B)
        qh = dims.q_heads_of(t)
        kh = dims.kv_heads_of(t)
        hq = x @ f32(w["q_w"]).T + f32(w["q_b"])
        hk = x @ f32(w["k_w"]).T + f32(w["k_b"])
        np.testing.assert_allclose(out[:, :len(qh) * d], hq[:, qh[0] * d:(qh[-1] + 1) * d], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(out[:, len(qh) * d:(len(qh) + 1) * d], hk[:, kh[0] * d:(kh[0] + 1) * d],
                                   rtol=1e-5, atol=1e-4)
    # O projection: the partial sums over TP ranks give HF's o_proj, in kernel lanes
    a = rng.standard_normal((3, q * d)).astype(np.float32)
    part = sum(a[:, t * dims.q_l * d:(t + 1) * dims.q_l * d] @ f32(attention.w_out(dims, t, w["o_w"]))
               for t in range(tp))
    np.testing.assert_allclose(hidden.from_kernel(part, 1, H), a @ f32(w["o_w"]).T, rtol=1e-5, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31))
def test_replicated_roundtrips(seed):
    rng = np.random.default_rng(seed)
    dims = Dims.of(preset("tiny"))
    H, E = dims.H, dims.E
    norm = rng.standard_normal(H).astype(BF)
    r = replicated.row(dims, norm)
    assert r.shape == (1, dims.Hp) and r.dtype == BF
    assert np.array_equal(_bits(replicated.row_inverse(dims, r)), _bits(norm))
    # router: bf16 values inside fp16's normal range convert exactly both ways
    rw = (rng.uniform(0.01, 4, (E, H)) * rng.choice([-1, 1], (E, H))).astype(BF)
    k = replicated.router_weights(dims, rw)
    assert k.shape == (dims.Hp, E) and k.dtype == np.float16
    assert np.array_equal(_bits(replicated.router_weights_inverse(dims, k, BF)), _bits(rw))
    rb = rng.uniform(-4, 4, E).astype(BF)
    assert np.array_equal(_bits(replicated.router_bias_inverse(replicated.router_bias(rb), BF)), _bits(rb))
    g = replicated.gamma(dims, norm)
    assert g.dtype == np.float32 and g.shape == (1, dims.Hp)
    assert np.array_equal(_bits(replicated.gamma_inverse(dims, g, BF)), _bits(norm))


def test_kernel_reader_router_matches_hf():
    rng = np.random.default_rng(2)
    dims = Dims.of(preset("tiny"))
    rw = (rng.standard_normal((dims.E, dims.H)) * 0.05).astype(BF)
    x = rng.standard_normal((2, dims.H)).astype(np.float32)
    got = hidden.to_kernel(x, 1, dims.Hp) @ replicated.router_weights(dims, rw).astype(np.float32)
    np.testing.assert_allclose(got, x @ rw.astype(np.float32).T, rtol=1e-4, atol=1e-4)
