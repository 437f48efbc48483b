import hashlib
import json

import numpy as np
import pytest

from gkbuild.checkpoint.reader import INDEX, Checkpoint
from gkbuild.checkpoint.safetensors_io import read_header
from gkbuild.checkpoint.synth import synthesize
from gkbuild.model import preset
from tests.conftest import run_cli


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_deterministic_per_seed(tmp_path):
    cfg = preset("tiny").with_layers(1)
    a = synthesize(cfg, tmp_path / "a", seed=3)
    b = synthesize(cfg, tmp_path / "b", seed=3, jobs=1)  # thread count does not change the bytes
    c = synthesize(cfg, tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_shards_like_the_hub(tiny_ckpt):
    index = json.loads((tiny_ckpt / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    total = sum(t.nbytes for f in files for t in read_header(tiny_ckpt / f).tensors.values())
    assert index["metadata"]["total_size"] == total
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["model_type"] == "gpt_oss" and cfg["rope_scaling"]["rope_type"] == "yarn"


def test_weights_have_realistic_scale(tiny_ckpt):
    ck = Checkpoint.open(tiny_ckpt)
    c = ck.config
    q = ck.read("model.layers.0.self_attn.q_proj.weight").astype(np.float32)
    assert 0.5 < np.sqrt((q ** 2).mean()) * np.sqrt(c.H) < 2.0
    scales = ck.read("model.layers.0.mlp.experts.gate_up_proj_scales")
    assert abs(int(np.median(scales)) - 127) <= 8  # near 2^0, not garbage
    from gkbuild.checkpoint.mxfp4 import decode

    w = decode(ck.read("model.layers.0.mlp.experts.gate_up_proj_blocks")[0],
               ck.read("model.layers.0.mlp.experts.gate_up_proj_scales")[0])
    assert 0.5 < np.sqrt((w ** 2).mean()) * np.sqrt(c.H) < 2.0


def test_refuses_to_overwrite(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("mine")
    r = run_cli("synth", "tiny", "--out", str(tmp_path / "x"), "-q")
    assert r.returncode == 1 and "already exists" in r.stderr
    assert (tmp_path / "x" / "keep").read_text() == "mine"


# CONTRACT.md section 1, written out independently of gkbuild.checkpoint.names.
def _contract_120b_layer(n):
    p = f"model.layers.{n}."
    bf = "BF16"
    return {
        p + "self_attn.q_proj.weight": (bf, [4096, 2880]), p + "self_attn.q_proj.bias": (bf, [4096]),
        p + "self_attn.k_proj.weight": (bf, [512, 2880]), p + "self_attn.k_proj.bias": (bf, [512]),
        p + "self_attn.v_proj.weight": (bf, [512, 2880]), p + "self_attn.v_proj.bias": (bf, [512]),
        p + "self_attn.o_proj.weight": (bf, [2880, 4096]), p + "self_attn.o_proj.bias": (bf, [2880]),
        p + "self_attn.sinks": (bf, [64]),
        p + "mlp.router.weight": (bf, [128, 2880]), p + "mlp.router.bias": (bf, [128]),
        p + "mlp.experts.gate_up_proj_blocks": ("U8", [128, 5760, 90, 16]),
        p + "mlp.experts.gate_up_proj_scales": ("U8", [128, 5760, 90]),
        p + "mlp.experts.gate_up_proj_bias": (bf, [128, 5760]),
        p + "mlp.experts.down_proj_blocks": ("U8", [128, 2880, 90, 16]),
        p + "mlp.experts.down_proj_scales": ("U8", [128, 2880, 90]),
        p + "mlp.experts.down_proj_bias": (bf, [128, 2880]),
        p + "input_layernorm.weight": (bf, [2880]), p + "post_attention_layernorm.weight": (bf, [2880]),
    }


@pytest.mark.slow
def test_synth_120b_one_layer_matches_the_contract(tmp_path):
    out = tmp_path / "120b"
    r = run_cli("synth", "gpt-oss-120b", "--layers", "1", "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    want = _contract_120b_layer(0)
    want.update({"model.embed_tokens.weight": ("BF16", [201088, 2880]),
                 "lm_head.weight": ("BF16", [201088, 2880]), "model.norm.weight": ("BF16", [2880])})
    got = {}
    for f in out.glob("model-*.safetensors"):
        raw = f.read_bytes()[:200000]
        n = int.from_bytes(raw[:8], "little")
        h = json.loads(raw[8:8 + n])
        h.pop("__metadata__")
        got.update({k: (v["dtype"], v["shape"]) for k, v in h.items()})
    assert got == want
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["num_local_experts"] == 128 and cfg["vocab_size"] == 201088
    Checkpoint.open(out)  # and the reader agrees
