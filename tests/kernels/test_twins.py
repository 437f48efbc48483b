"""Pieces of the twins against independent references: transformers' RoPE, our MX decode."""

import dataclasses

import numpy as np
import torch

from gkbuild.checkpoint import mxfp4
from gkbuild.kernels import mx, rope
from gkbuild.layout import experts_mx, hidden
from gkbuild.layout.dims import Dims
from gkbuild.model import preset


def test_yarn_tables_match_transformers():
    from transformers import GptOssConfig as HF
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    cfg = preset("gpt-oss-120b")
    hf = HF(**{k: v for k, v in cfg.to_hf().items() if k not in ("quantization_config",)})
    emb = GptOssRotaryEmbedding(hf)
    pos = torch.tensor([[0, 1, 7, 128, 4095, 4096, 70000]])
    cos_hf, sin_hf = emb(torch.zeros(1, dtype=torch.float32), pos)
    r = {"theta": cfg.rope.theta, "factor": cfg.rope.factor, "beta_fast": cfg.rope.beta_fast,
         "beta_slow": cfg.rope.beta_slow, "original_max_position_embeddings": cfg.rope.original_max_position_embeddings,
         "truncate": cfg.rope.truncate, "concentration": cfg.rope.concentration}
    cos, sin = rope.tables(pos[0], cfg.d, r)
    torch.testing.assert_close(cos, cos_hf[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, sin_hf[0], rtol=1e-5, atol=1e-5)


def test_mx_reader_agrees_with_the_checkpoint_decode():
    """The twin's reader of the tiles and mxfp4.decode of the HF bytes give the same matrices."""
    rng = np.random.default_rng(0)
    d = Dims.of(dataclasses.replace(preset("tiny"), hidden_size=448, intermediate_size=960))
    gb = rng.integers(0, 256, (1, 2 * d.I, d.H // 32, 16), dtype=np.uint8)
    gs = rng.integers(118, 125, (1, 2 * d.I, d.H // 32), dtype=np.uint8)
    db = rng.integers(0, 256, (1, d.H, d.I // 32, 16), dtype=np.uint8)
    ds = rng.integers(118, 125, (1, d.H, d.I // 32), dtype=np.uint8)
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
