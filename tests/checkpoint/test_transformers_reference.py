"""transformers is the independent reader: it must load what gkbuild writes, and agree bit for bit."""

import numpy as np
import pytest
import torch

from gkbuild.checkpoint import mxfp4
from gkbuild.checkpoint.reader import Checkpoint


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    from transformers import GptOssForCausalLM, Mxfp4Config

    m = GptOssForCausalLM.from_pretrained(str(tiny_ckpt), quantization_config=Mxfp4Config(dequantize=True),
                                          dtype=torch.float32)
    return m.eval()


def test_transformers_loads_and_gives_finite_logits(hf_model):
    with torch.no_grad():
        logits = hf_model(torch.tensor([[1, 5, 9, 200, 3000, 7, 7, 42]])).logits
    assert logits.shape == (1, 8, hf_model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not a degenerate model


def test_dequantized_experts_equal_gkbuild_decode(hf_model, tiny_ckpt):
    ck = Checkpoint.open(tiny_ckpt)
    for layer in range(ck.config.L):
        experts = hf_model.model.layers[layer].mlp.experts
        p = f"model.layers.{layer}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            ours = mxfp4.decode(ck.read(p + proj + "_blocks"), ck.read(p + proj + "_scales"))  # [E, out, in]
            theirs = getattr(experts, proj).detach().numpy().transpose(0, 2, 1)  # HF keeps [E, in, out]
            assert np.array_equal(ours.view(np.uint32), np.ascontiguousarray(theirs).view(np.uint32)), proj
            bias = ck.read(p + proj + "_bias").astype(np.float32)
            assert np.array_equal(bias, getattr(experts, proj + "_bias").detach().numpy())
