"""The Quantized view: a dense checkpoint read as the MXFP4 one a build reads."""

import numpy as np
import pytest
import torch

from gkbuild import recipe
from gkbuild.checkpoint import mxfp4, names, quantize
from gkbuild.checkpoint.quantized import Quantized, as_float32, expert_to_mx, mx_to_expert, mx_view, to_bf16_bits
from gkbuild.checkpoint.reader import Checkpoint
from gkbuild.checkpoint.synth import synthesize
from gkbuild.errors import GkError
from gkbuild.model import preset

P = names.layer_prefix(1) + names.EXPERTS


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    for dtype in ("bf16", "fp32"):
        synthesize(preset("tiny"), root / dtype, seed=3, dtype=dtype)
    return root


def test_the_recipe_offers_exactly_the_quantizer_rules():
    assert recipe.SCALE_RULES == quantize.RULES


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("proj", names.PROJS)
def test_served_blocks_decode_to_the_dense_weights_within_half_a_grid_step(dense, dtype, proj):
    """The blocking axis and the transposition: each decoded value is the dense one to within half
    the e2m1 step at its block's scale (a wrong axis or transpose misses by the weights themselves)."""
    ck = Checkpoint.open(dense / dtype)
    view = Quantized(ck, "round_up")
    w = as_float32(ck.read(P + proj, 2, 4))  # [2, in, out]
    blocks, scales = view.read(P + proj + "_blocks", 2, 4), view.read(P + proj + "_scales", 2, 4)
    assert blocks.shape == (2, w.shape[2], w.shape[1] // 32, 16) and scales.shape == blocks.shape[:-1]
    got = mx_to_expert(blocks, scales)
    step = np.ldexp(1.0, scales.astype(np.int32) - 127)  # the largest e2m1 gap (2) x scale / 2
    bound = np.repeat(step, 32, axis=-1).transpose(0, 2, 1)
    err = np.abs(got - w)
    assert (err <= bound).all()
    assert (err > 0).any(), "the dense synth holds values off the MXFP4 grid"


def test_a_slice_is_quantized_once_for_its_blocks_and_scales(dense, monkeypatch):
    ck = Checkpoint.open(dense / "bf16")
    view = Quantized(ck, "floor")
    calls = []
    real = ck.read
    monkeypatch.setattr(ck, "read", lambda name, lo=None, hi=None: (calls.append((name, lo, hi)), real(name, lo, hi))[1])
    b = view.read(P + "down_proj_blocks", 0, 1)
    s = view.read(P + "down_proj_scales", 0, 1)
    assert calls == [(P + "down_proj", 0, 1)]
    assert all(np.array_equal(a, e) for a, e in zip((b, s), expert_to_mx(as_float32(real(P + "down_proj", 0, 1)), "floor")))


def test_an_fp32_source_is_served_in_bf16_rounded_as_torch_rounds(dense):
    ck = Checkpoint.open(dense / "fp32")
    name = names.layer_prefix(0) + "self_attn.q_proj.weight"
    got = Quantized(ck, "round_up").read(name)
    want = torch.from_numpy(np.array(ck.read(name))).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert got.dtype.name == "bfloat16" and np.array_equal(got.view(np.uint16), want)
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.0e-39, 1.0], np.float32)  # ties both ways, a denormal
    assert np.array_equal(to_bf16_bits(x), torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_the_original_serves_dense_experts_and_refuses_their_blocks(dense):
    ck = Checkpoint.open(dense / "bf16")
    orig = mx_view(ck, None)
    assert np.array_equal(orig.read(P + "gate_up_proj", 0, 1), as_float32(ck.read(P + "gate_up_proj", 0, 1)))
    with pytest.raises(GkError, match="dense original"):
        orig.read(P + "gate_up_proj_blocks", 0, 1)
    with pytest.raises(GkError, match="read quantized"):
        Quantized(ck, "round_up").read(P + "gate_up_proj", 0, 1)


def test_an_mxfp4_checkpoint_is_read_as_published(tiny_ckpt):
    ck = Checkpoint.open(tiny_ckpt)
    assert mx_view(ck, "round_up") is ck and mx_view(ck, None) is ck


def test_an_on_grid_dense_source_quantizes_back_to_its_values(tiny_ckpt):
    """mx_to_expert then expert_to_mx: the values of every MXFP4 expert come back (the bytes, where
    the block's largest code is 4 or 6: quantize's docstring)."""
    ck = Checkpoint.open(tiny_ckpt)
    name = names.layer_prefix(0) + names.EXPERTS + "gate_up_proj"
    b, s = np.array(ck.read(name + "_blocks")), np.array(ck.read(name + "_scales"))
    b2, s2 = expert_to_mx(mx_to_expert(b, s), "round_up")
    assert np.array_equal(mxfp4.decode(b2, s2), mxfp4.decode(b, s))
