import json

import pytest

from gkbuild.errors import GkError
from gkbuild.model import FULL, PRESETS, SLIDING, GptOssConfig, match_preset, preset

# The hub's openai/gpt-oss-120b config.json (the fields gkbuild reads), as published.
HUB_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(36)],
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128,
    "pad_token_id": 199999, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "vocab_size": 201088,
}


def test_hub_config_is_the_120b_preset():
    cfg = GptOssConfig.from_hf(HUB_120B)
    assert cfg == PRESETS["gpt-oss-120b"]
    assert match_preset(cfg) == "gpt-oss-120b"
    assert abs(cfg.rope.concentration - (0.1 * __import__("math").log(32) + 1)) < 1e-12


def test_roundtrip_through_hf_form():
    for name, cfg in PRESETS.items():
        again = GptOssConfig.from_hf(json.loads(json.dumps(cfg.to_hf())))
        assert again == cfg, name
        assert match_preset(cfg.with_layers(1)) == name


def test_new_style_rope_parameters():
    d = dict(HUB_120B)
    d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}
    assert GptOssConfig.from_hf(d) == PRESETS["gpt-oss-120b"]


def test_contract_numbers():
    c = preset("gpt-oss-120b")
    assert (c.L, c.E, c.H, c.I, c.q_heads, c.kv_heads, c.d, c.V, c.top_k) == \
        (36, 128, 2880, 2880, 64, 8, 64, 201088, 4)
    c = preset("gpt-oss-20b")
    assert (c.L, c.E) == (24, 32)
    t = preset("tiny-topology")
    assert (t.q_heads, t.kv_heads, t.E, t.top_k) == (64, 8, 128, 4)
    for name in ("tiny", "tiny-topology"):
        c = preset(name)
        assert c.H % 512 and c.I % 512, "tiny hidden sizes must need MX padding"
        assert c.L == 2 and c.layer_types == (SLIDING, FULL)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type"),
    ({"quantization_config": None}, "mxfp4"),
    ({"hidden_size": 2881}, "multiple of 32"),
    ({"num_key_value_heads": 7}, "not a multiple"),
    ({"num_experts_per_tok": 200}, "exceeds"),
    ({"layer_types": ["sliding_attention"]}, "layer_types has 1 entries"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope type"),
    ({"num_hidden_layers": -1, "layer_types": []}, "must be an integer in 1"),
])
def test_bad_configs(change, message):
    d = dict(HUB_120B)
    d.update(change)
    with pytest.raises(GkError, match=message):
        GptOssConfig.from_hf(d)


def test_unknown_preset_suggests():
    with pytest.raises(GkError, match="did you mean 'tiny'"):
        preset("tinyy")


def test_no_quantization_config_is_a_dense_checkpoints_config():
    """As transformers saves a fine-tune dequantized for training: the reader then holds its
    tensors to the dense layout (tests/checkpoint/test_dense.py)."""
    d = dict(HUB_120B)
    d.pop("quantization_config")
    cfg = GptOssConfig.from_hf(d)
    assert cfg == PRESETS["gpt-oss-120b"] and "quantization_config" not in cfg.extra
    assert "quantization_config" in GptOssConfig.from_hf(HUB_120B).extra
