"""config.json values checked for type and range before anything is sized from them."""

import json

import pytest

from gkbuild.errors import GkError
from gkbuild.model import GptOssConfig, preset


def _cfg(**change) -> dict:
    d = preset("tiny").to_hf()
    d.update(change)
    return d


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 0}, r"num_attention_heads must be an integer in 1\.\.2147483648, got 0"),
    ({"num_hidden_layers": 1000000, "layer_types": None}, r"num_hidden_layers must be an integer in 1\.\.1024"),
    ({"hidden_size": "960"}, r"hidden_size must be an integer .* got '960'"),
    ({"vocab_size": True}, r"vocab_size must be an integer"),
    ({"rope_scaling": [1, 2]}, r"rope_scaling must be an object, got \[1, 2\]"),
    ({"swiglu_limit": float("nan")}, r"swiglu_limit must be a finite number, got nan"),
    ({"rope_theta": float("inf")}, r"rope_theta must be a finite number, got inf"),
    ({"rope_theta": -1}, r"rope_theta must be a finite positive number, got -1"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps must be a finite positive number"),
    ({"layer_types": "sliding"}, r"layer_types must be a list of strings"),
])
def test_bad_config_values_are_one_line_errors(change, message):
    with pytest.raises(GkError, match=message):
        GptOssConfig.from_hf(_cfg(**change))


def test_nan_in_a_config_file_is_refused(tmp_path):
    # json.dumps writes NaN / Infinity tokens: what a hostile config.json holds
    (tmp_path / "config.json").write_text(json.dumps(_cfg(swiglu_limit=float("nan"))))
    with pytest.raises(GkError, match=r"config.json: not valid JSON \(NaN is not strict JSON\)"):
        GptOssConfig.from_file(tmp_path / "config.json")
    (tmp_path / "c2").mkdir()
    (tmp_path / "c2" / "config.json").mkdir()
    with pytest.raises(GkError, match=r"config.json: is a folder, not a config file"):
        GptOssConfig.from_file(tmp_path / "c2" / "config.json")
