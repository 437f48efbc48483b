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
    """Our on-demand expert loop (one MXFP4 expert decoded at a time, a few rows at a time)
    against transformers' GptOssExperts of the same layer, on the same tokens and routing; with
    probe rows, every expert's output on them is its transformers output too."""
    from gkbuild.checkpoint.reader import Checkpoint

    ck = Checkpoint.open(tiny_ckpt)
    cfg = reference.hf_config(tiny_ckpt, KvFormat("fp32"))
    layer = reference.Layer(ck, cfg, 1, "cpu")
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    probe = reference.probe_rows(cfg.hidden_size)
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        _, scores, idx = layer.router(x)
        ours, probed = layer.experts(x, idx, scores, probe)
        theirs = hf_model.model.layers[1].mlp.experts(x, idx, scores)
        # expert e alone on the probe rows: every row routed to e (first slot) at affinity 1
        alone = torch.stack([hf_model.model.layers[1].mlp.experts(
            probe, torch.tensor([[e] + [(e + j) % E for j in range(1, k)]] * len(probe)),
            torch.tensor([[1.0] + [0.0] * (k - 1)] * len(probe))) for e in range(E)])
    ck.close()
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    assert probed.shape == (E, len(probe), cfg.hidden_size)
    assert float((probed - alone).abs().max()) <= 1e-5 * float(alone.abs().max())


def test_the_reference_decodes_mxfp4_with_transformers_not_the_builds_decoder(tiny_ckpt, streamed, monkeypatch):
    """The build's own MXFP4 decoders are not on the reference's path (a bug there stays visible
    to verify); transformers' convert_moe_packed_tensors is (what it returns is what the reference uses)."""
    from gkbuild import hf_mxfp4
    from gkbuild.checkpoint import mxfp4
    from gkbuild.kernels import mx

    prompts = streamed["token_ids"][:, :5].tolist()
    monkeypatch.setattr(mxfp4, "decode", lambda *a, **k: pytest.fail("the build's mxfp4.decode was called"))
    monkeypatch.setattr(mx, "_unpack_x4", lambda *a, **k: pytest.fail("the twin's MX reader was called"))
    again = reference.run(tiny_ckpt, prompts, steps=6, kv=KvFormat("fp32"))
    assert torch.equal(again["logits"], streamed["logits"])
    import transformers.integrations.mxfp4 as hf

    real = hf.convert_moe_packed_tensors
    monkeypatch.setattr(hf, "convert_moe_packed_tensors", lambda b, s, **k: -real(b, s, **k))
    hf_mxfp4.tables.cache_clear()
    try:  # the table and each layer's check come from the function: its (negated) weights are the ones used
        negated = reference.run(tiny_ckpt, prompts, steps=1, kv=KvFormat("fp32"))
        # layer 0's experts on the probe rows depend on nothing but their weights
        assert torch.isclose(negated["expert_outputs"][0], streamed["expert_outputs"][0]).float().mean() < 0.01
    finally:
        monkeypatch.undo()
        hf_mxfp4.tables.cache_clear()


def test_tabulated_decode_is_transformers_on_every_byte_and_scale():
    """Every block byte at every scale (the table's whole domain, 0 and 254 included: subnormal and
    infinite products), then random bytes and scales in an expert-shaped projection: the decode is
    convert_moe_packed_tensors's output bit for bit, as GPT-OSS lays it out ([experts, G*32, R])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from gkbuild import hf_mxfp4

    pairs = hf_mxfp4.tables()
    assert pairs.shape == (65536, 2) and np.isnan(pairs[255 << 8:]).all()
    assert tuple(pairs[127 << 8 | 0x21]) == (0.5, 1.0) and tuple(pairs[128 << 8 | 0xF8]) == (-0.0, -12.0)

    def theirs(blocks, scales):  # [R, G, 16], [R, G] -> [R, G*32]: one expert, transposed back
        return convert_moe_packed_tensors(torch.from_numpy(blocks)[None], torch.from_numpy(scales)[None],
                                          dtype=torch.float32)[0].T.contiguous()

    rng = np.random.default_rng(0)
    every = np.stack([rng.permutation(256).astype(np.uint8).reshape(16, 16) for _ in range(255)])  # a scale a row
    scales = np.repeat(np.arange(255, dtype=np.uint8)[:, None], 16, axis=1)
    got, want = hf_mxfp4.dense(every, scales), theirs(every, scales)
    assert torch.isinf(want).any() and (want.abs() < 2.0 ** -126).logical_and(want != 0).any()
    assert torch.equal(torch.from_numpy(got).view(torch.int32), want.view(torch.int32))
    blocks = rng.integers(0, 256, (96, 3, 16), dtype=np.uint8)
    scales = rng.choice(np.array([0, 1, 2, 120, 127, 130, 253, 254], np.uint8), (96, 3))
    assert torch.equal(torch.from_numpy(hf_mxfp4.dense(blocks, scales)).view(torch.int32),
                       theirs(blocks, scales).view(torch.int32))
    hf_mxfp4.check_layout(blocks, scales, "x")
    x = torch.randn(5, 96, dtype=torch.float32)
    scales = rng.integers(120, 130, (96, 3), dtype=np.uint8)
    y, ref = hf_mxfp4.matmul_t(x, blocks, scales, rows=7), x @ theirs(blocks, scales).T  # 7 rows at a time
    assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_a_decode_that_departs_from_transformers_is_caught(monkeypatch):
    """Nibbles in the wrong order (a classic MXFP4 bug) in the table: check_layout refuses."""
    from gkbuild import hf_mxfp4

    pairs = hf_mxfp4.tables()
    monkeypatch.setattr(hf_mxfp4, "tables", lambda: np.ascontiguousarray(pairs[:, ::-1]))
    blocks = np.random.default_rng(1).integers(0, 256, (8, 2, 16), dtype=np.uint8)
    with pytest.raises(GkError, match="expert 3: the tabulated MXFP4 decode differs from transformers"):
        hf_mxfp4.check_layout(blocks, np.full((8, 2), 127, np.uint8), "expert 3")


def test_layers_are_loaded_once_while_they_fit_the_budget(tiny_ckpt, streamed, monkeypatch):
    """A layer's modules are read and converted once a run and kept for the later passes while the
    kept ones fit LAYERS_KEEP, and loaded again every pass past it: the same numbers either way."""
    from gkbuild.checkpoint.reader import Checkpoint

    ck = Checkpoint.open(tiny_ckpt)
    one = reference.Layer(ck, reference.hf_config(tiny_ckpt, KvFormat("fp32")), 0, "cpu").nbytes
    ck.close()
    loads = []
    real = reference.Layer.__init__

    def counted(self, ck, cfg, i, device):
        loads.append(i)
        real(self, ck, cfg, i, device)

    monkeypatch.setattr(reference.Layer, "__init__", counted)
    prompts = streamed["token_ids"][:, :5].tolist()
    kept = reference.run(tiny_ckpt, prompts, steps=6, kv=KvFormat("fp32"))
    assert loads == [0, 1]  # 2 layers, 7 passes
    monkeypatch.setattr(reference, "LAYERS_KEEP", one)  # room for one layer
    loads.clear()
    again = reference.run(tiny_ckpt, prompts, steps=6, kv=KvFormat("fp32"))
    assert loads == [0] + [1] * 7
    assert all(torch.equal(kept[k], again[k]) and torch.equal(kept[k], streamed[k]) for k in kept)


def test_prompts_of_different_lengths_continue_greedily_to_the_longest(tiny_ckpt):
    """A sequence shorter than the longest prompt takes its greedy tokens until it: the same
    tokens and logits as running it alone (batched sums differ only in rounding)."""
    both = reference.run(tiny_ckpt, [[1, 2, 3], [4, 5, 6, 7, 8]], steps=2, kv=KvFormat("bf16"))
    short = reference.run(tiny_ckpt, [[1, 2, 3]], steps=4, kv=KvFormat("bf16"))
    long = reference.run(tiny_ckpt, [[4, 5, 6, 7, 8]], steps=2, kv=KvFormat("bf16"))
    assert both["token_ids"].shape == (2, 7)
    assert torch.equal(both["token_ids"][0], short["token_ids"][0]) and torch.equal(both["token_ids"][1], long["token_ids"][0])
    assert float((both["logits"][0] - short["logits"][0]).abs().max()) < 1e-4
    assert float((both["logits"][1] - long["logits"][0]).abs().max()) < 1e-4
    assert both["final_norm"].shape == (2, 7, 960) and both["expert_outputs"].shape == (2, 8, reference.PROBES, 960)


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


@pytest.mark.parametrize("fmt", ["gkbuild-golden-1", "gkbuild-golden-2"])
def test_old_goldens_are_refused_with_a_reason(tmp_path, fmt):
    from safetensors.torch import save_file

    p = tmp_path / "old.safetensors"
    save_file({"token_ids": torch.zeros(1, 2, dtype=torch.int64)}, str(p),
              metadata={"format": fmt, "prompt_len": "1", "meta": "{}"})
    with pytest.raises(GkError, match="older gkbuild.*regenerate"):
        Golden.load(p)


def test_progress_names_the_position_and_layer(tiny_ckpt, monkeypatch):
    """The golden's bar counts layer-passes (so its ETA is the whole run's) and names where it is."""
    import contextlib

    seen, total = [], []

    @contextlib.contextmanager
    def bar(description, n, quiet=False):
        total.append(n)
        yield lambda k, where="": seen.append(where)

    monkeypatch.setattr(reference, "steps_bar", bar)
    reference.run(tiny_ckpt, [[1, 2, 3], [4, 5, 6, 7]], steps=1, kv=KvFormat("bf16"))
    assert total == [3 * 2] and len(seen) == 6  # positions 1-3 together, then 4 and 5; 2 layers each
    assert seen[:3] == ["positions 1-3/5, layer 1/2", "positions 1-3/5, layer 2/2", "position 4/5, layer 1/2"]
