"""The streamed reference against transformers' own GptOssForCausalLM, its KV rounding against
ml_dtypes, and its device plumbing."""

import ml_dtypes
import numpy as np
import pytest
import torch

from gkbuild import reference
from gkbuild.errors import GkError
from gkbuild.golden import Golden, default_prompts
from gkbuild.reference import KvFormat
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    import transformers
    from transformers import GptOssForCausalLM, Mxfp4Config

    transformers.utils.logging.set_verbosity_error()
    return GptOssForCausalLM.from_pretrained(str(tiny_ckpt), quantization_config=Mxfp4Config(dequantize=True),
                                             dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def streamed(tiny_ckpt):
    return reference.run(tiny_ckpt, default_prompts(4096, 3, 5), steps=6, kv=KvFormat("fp32"))


def test_streamed_reference_matches_the_full_transformers_model(hf_model, streamed):
    """Same greedy tokens, logits within 1e-5, hidden states within 1e-5, identical routing."""
    routes, hidden = [], []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: routes.append(o[2]))
             for layer in hf_model.model.layers]
    hooks += [layer.register_forward_hook(lambda m, i, o: hidden.append(o[0] if isinstance(o, tuple) else o))
              for layer in hf_model.model.layers]
    try:
        with torch.no_grad():
            out = hf_model(streamed["token_ids"])
    finally:
        for h in hooks:
            h.remove()
    assert (out.logits[:, 4:-1].argmax(-1) == streamed["token_ids"][:, 5:]).all()  # the greedy continuation
    assert float((out.logits - streamed["logits"]).abs().max()) <= 1e-5
    P, T = streamed["token_ids"].shape
    assert float((torch.stack(hidden, dim=1) - streamed["hidden"]).abs().max()) <= 1e-5
    hf_routing = torch.stack([r.view(P, T, -1) for r in routes], dim=1)
    assert torch.equal(hf_routing, streamed["routing"])
    assert (streamed["router_gap"] >= 0).all()


def test_expert_loop_matches_transformers_experts(tiny_ckpt, hf_model):
    """Our on-demand expert loop (one MXFP4 expert dequantized at a time) against transformers'
    GptOssExperts of the same layer, on the same tokens and routing."""
    from gkbuild.checkpoint.reader import Checkpoint

    ck = Checkpoint.open(tiny_ckpt)
    cfg = reference.hf_config(tiny_ckpt, KvFormat("fp32"))
    layer = reference.Layer(ck, cfg, 1, "cpu")
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, scores, idx = layer.router(x)
        ours = layer.experts(x, idx, scores)
        theirs = hf_model.model.layers[1].mlp.experts(x, idx, scores)
    ck.close()
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


def test_attention_with_exact_active_keys_is_transformers_eager(hf_model):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    attn = hf_model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 3, 64, generator=g)
    k, v = torch.randn(2, 2, 7, 64, generator=g), torch.randn(2, 2, 7, 64, generator=g)
    mask = reference._mask(torch.arange(4, 7), 7, None)
    cache = reference._Cache(KvFormat("fp32"))
    cache.active = (k[:, :, 4:], v[:, :, 4:])
    ours, _ = reference._attention(attn, q, k, v, mask, 0.125, gk_cache=cache)
    theirs, _ = eager_attention_forward(attn, q, k, v, mask, 0.125)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,ml,top", [("fp8_e4m3", ml_dtypes.float8_e4m3, 240.0),
                                          ("fp8_e4m3fn", ml_dtypes.float8_e4m3fn, 448.0)])
def test_fp8_cache_rounds_like_the_format(dtype, ml, top):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 300
    f = KvFormat(dtype, k_scale=0.5, v_scale=2.0)
    want = np.clip(x.numpy() / 0.5, -top, top).astype(ml).astype(np.float32) * 0.5
    np.testing.assert_array_equal(f.stored(x, f.k_scale).numpy(), want)
    assert float(f.stored(x, 0.5).abs().max()) == top * 0.5  # saturated, not inf/NaN
    torch.testing.assert_close(f.active(x, 0.5), (x / 0.5).clamp(-top, top) * 0.5)  # unrounded


def test_bf16_and_exact_caches():
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(KvFormat("fp32").stored(x, 1.0), x)
    assert torch.equal(KvFormat("bf16").stored(x, 1.0), x.bfloat16().float())
    assert torch.equal(KvFormat("bf16").active(x, 1.0), x)
    with pytest.raises(GkError, match="unknown KV format"):
        KvFormat("fp8")
    with pytest.raises(GkError, match="positive"):
        KvFormat("fp8_e4m3", k_scale=0.0)


def test_the_fp8_reference_departs_from_the_exact_one(tiny_ckpt, streamed):
    """The rounding is real: an FP8 cache changes the logits, a bf16 one barely."""
    prompts = streamed["token_ids"][:, :5].tolist()
    bf = reference.run(tiny_ckpt, prompts, steps=1, kv=KvFormat("bf16"))
    fp8 = reference.run(tiny_ckpt, prompts, steps=1, kv=KvFormat("fp8_e4m3"))
    exact = streamed["logits"][:, :6]
    assert 0 < float((bf["logits"] - exact).abs().max()) < 0.05
    assert float((fp8["logits"] - exact).abs().max()) > float((bf["logits"] - exact).abs().max())


def test_device_cuda_is_refused_without_a_gpu_in_one_line(tiny_ckpt, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the CUDA run below covers it")
    with pytest.raises(GkError, match="no CUDA device"):
        reference.run(tiny_ckpt, [[1, 2]], steps=1, device="cuda")
    r = run_cli("golden", str(tiny_ckpt), "--out", str(tmp_path / "g.safetensors"), "--device", "cuda",
                "--prompts", "1", "--steps", "1")
    assert r.returncode != 0 and r.stderr.strip() == "gkbuild: error: --device cuda: no CUDA device is available " \
                                                      "on this host"
    assert not (tmp_path / "g.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")
def test_cuda_reference_matches_cpu(tiny_ckpt, streamed):
    prompts = streamed["token_ids"][:, :5].tolist()
    cuda = reference.run(tiny_ckpt, prompts, steps=6, kv=KvFormat("fp32"), device="cuda")
    assert torch.equal(cuda["token_ids"], streamed["token_ids"])
    assert float((cuda["logits"] - streamed["logits"]).abs().max()) <= 1e-3


def test_golden_cli_records_the_kv_format(tiny_ckpt, tmp_path):
    out = tmp_path / "g.safetensors"
    r = run_cli("golden", str(tiny_ckpt), "--out", str(out), "--prompts", "1", "--steps", "1", "--kv", "fp8_e4m3",
                "--k-scale", "0.5", "--v-scale", "2", "-q")
    assert r.returncode == 0, r.stderr
    g = Golden.load(out)
    assert g.kv == KvFormat("fp8_e4m3", 0.5, 2.0) and g.token_ids.shape == (1, 5)
    r = run_cli("golden", str(tiny_ckpt), "--out", str(tmp_path / "bad.safetensors"), "--kv", "fp8_e4m3",
                "--k-scale", "0")
    assert r.returncode != 0 and r.stderr.strip().startswith("gkbuild: error: KV scales must be positive")


def test_old_goldens_are_refused_with_a_reason(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "old.safetensors"
    save_file({"token_ids": torch.zeros(1, 2, dtype=torch.int64)}, str(p),
              metadata={"format": "gkbuild-golden-1", "prompt_len": "1", "meta": "{}"})
    with pytest.raises(GkError, match="older gkbuild.*regenerate"):
        Golden.load(p)
