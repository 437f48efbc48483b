import json
import shutil

import pytest

from gkbuild import recipe
from gkbuild.errors import GkError
from gkbuild.model import preset
from gkbuild.plan import make_plan
from tests.conftest import RECIPES, run_cli


def _plan(name, **over):
    r = recipe.load(RECIPES / f"{name}.yaml", [f"{k}={v}" for k, v in over.items()])
    return make_plan(r, preset({"gpt-oss-120b-trn2": "gpt-oss-120b", "gpt-oss-120b-trn3": "gpt-oss-120b",
                                "gpt-oss-20b-trn2": "gpt-oss-20b"}.get(name, "tiny-topology")))


def test_120b_rank0_contract_shapes():
    j = _plan("gpt-oss-120b-trn2").to_json()
    rt = {k: (v["shape"], v["dtype"]) for k, v in j["rank_tensors"].items()}
    assert rt["W_qkv"] == ([36, 3072, 640], "bf16")
    assert rt["bias_qkv"] == ([36, 1, 640], "bf16")
    assert rt["W_out"] == ([36, 512, 3072], "bf16")
    assert rt["sink"] == ([36, 8, 1], "bf16")
    assert rt["router_weights"] == ([36, 3072, 128], "fp16")
    assert rt["router_bias"] == ([36, 1, 128], "fp16")
    assert rt["input_layernorm_weight"] == ([36, 1, 3072], "bf16")
    assert rt["expert_gate_up_weights"] == ([36, 1, 128, 2, 6, 3072], "u16")
    assert rt["expert_gate_up_weights_scale"] == ([36, 1, 16, 2, 6, 3072], "u8")
    assert rt["expert_gate_up_bias"] == ([36, 1, 128, 2, 6, 4], "fp32")
    assert rt["expert_down_weights"] == ([36, 1, 128, 6, 3072], "u16")
    assert rt["expert_down_weights_scale"] == ([36, 1, 16, 6, 3072], "u8")
    assert rt["expert_down_bias"] == ([36, 1, 3072], "fp32")
    assert rt["lm_head_weight_t"] == ([3072, 1571], "bf16")
    assert rt["gamma"] == ([1, 3072], "fp32")
    assert j["ranks"] == 128
    kv = j["kv"]
    assert kv["form"] == "stacked" and kv["entries"] == 36 and kv["num_blocks"] == 14563
    assert kv["block_size"] == 128 and kv["bytes_per_rank"] == 36 * 2 * 14563 * 8192
    assert kv["k_entry_shape"] == [14563, 1, 64, 64, 2] and kv["allocation_shape"] == [36, 14563, 1, 128, 64]
    assert j["tail"] == {"vocab_per_rank": 1571, "hops": [8, 16], "k": 256}
    assert j["bytes_per_rank"] == sum(s.nbytes for _, s in _plan("gpt-oss-120b-trn2").rank_tensors(0).values())
    assert j["scalars"]["softmax_scale"] == pytest.approx(0.125)
    assert j["scalars"]["up_clamp_upper_limit"] == 8.0


def test_trn3_uses_ocp_fp8():
    assert _plan("gpt-oss-120b-trn3").to_json()["kv"]["dtype"] == "fp8_e4m3fn"
    assert _plan("gpt-oss-120b-trn2").to_json()["kv"]["dtype"] == "fp8_e4m3"


def test_tiny_topology_mirrors_120b_per_rank():
    big, tiny = _plan("gpt-oss-120b-trn2"), _plan("tiny-topology-trn2")
    assert tiny.world == big.world == 128
    assert set(tiny.rank_tensors(0)) == set(big.rank_tensors(0))
    for rank in (0, 77, 127):
        assert (tiny.dims.q_l, tiny.dims.kv_l, tiny.dims.E_L) == (big.dims.q_l, big.dims.kv_l, big.dims.E_L) == \
            (8, 1, 1)
        assert [f.role for f in tiny.files_of(rank)] == ["shared", "attn", "expert", "tail"]
    assert {f.role: len(f.ranks) for f in tiny.files} == {"shared": 128, "attn": 16, "expert": 1, "tail": 1}
    assert len([f for f in tiny.files if f.role == "attn"]) == 8  # DP replicas share one file
    assert tiny.meshes["tp_replica_group"][1] == tuple(range(8, 16))


def test_files_are_unique_and_dedup():
    p = _plan("gpt-oss-120b-trn2")
    assert len({f.path for f in p.files}) == len(p.files) == 1 + 8 + 128 + 128
    assert p.disk_bytes < p.weight_bytes(0) * p.world


@pytest.mark.parametrize("over, message", [
    ({"topology.tp": 6, "topology.dp": 2, "topology.ep": 12, "topology.vtp": 12, "topology.hops": "[12]",
      "decode.batch_sizes": "[12]"}, r"topology.tp: 6 does not divide the 64 attention heads"),
    ({"topology.tp": 8, "topology.dp": 3, "topology.ep": 24, "topology.vtp": 24, "topology.hops": "[24]",
      "decode.batch_sizes": "[24]"}, r"topology.ep: 24 does not divide the 128 experts"),
    ({"topology.hops": "[4, 16]"}, r"hop sizes must multiply to vtp = 128"),
    ({"kv_cache.num_blocks": "null", "kv_cache.hbm_per_rank_gib": 2, "kv_cache.memory_utilization": 0.9},
     r"the KV budget does not fit: 1.93 GiB of weights per rank leave 0.00 GiB of 1.80 GiB usable"),
    ({"kv_cache.num_blocks": 14564}, r"exceed the uint32 DMA offset cap of 14,563 for the stacked form .*"
                                     r"per_buffer lifts it to 524,288"),
    ({"kv_cache.num_blocks": 600000, "kv_cache.form": "per_buffer"}, r"cap of 524,288 for the per_buffer form"),
])
def test_bad_recipes_against_the_real_config(over, message):
    with pytest.raises(GkError, match=message):
        _plan("gpt-oss-120b-trn2", **over)


def test_budget_mode():
    p = _plan("gpt-oss-120b-trn2", **{"kv_cache.num_blocks": "null", "kv_cache.hbm_per_rank_gib": 24,
                                       "kv_cache.memory_utilization": 0.9})
    j = p.to_json()["kv"]
    usable = int(24 * 2**30 * 0.9)
    fit = (usable - p.weight_bytes(0)) // (36 * 2 * 8192)  # stacked: an entry a layer
    assert j["num_blocks"] == min(fit, 14563) and j["budget"]["mode"] == "hbm"
    assert j["budget"]["fits_blocks"] == fit and j["budget"]["capped_by_dma"] == (fit > 14563)
    pb = _plan("gpt-oss-120b-trn2", **{"kv_cache.num_blocks": "null", "kv_cache.hbm_per_rank_gib": 24,
                                        "kv_cache.memory_utilization": 0.9, "kv_cache.form": "per_buffer"})
    assert pb.to_json()["kv"]["num_blocks"] == (usable - pb.weight_bytes(0)) // (18 * 2 * 8192)


def test_plan_cli_against_a_hub_cache(tmp_path):
    """hf:// planning reads only config.json: lay out a cache holding just that file."""
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    snap = tmp_path / "hub" / "models--openai--gpt-oss-120b" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(preset("gpt-oss-120b").to_hf()))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn2.yaml"), "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    j = json.loads(r.stdout)
    assert j["rank_tensors"]["W_qkv"]["shape"] == [36, 3072, 640]
    assert j["kv"]["bytes_per_rank"] == 36 * 2 * 14563 * 8192
    # without the cache: the built-in config, said out loud
    shutil.rmtree(tmp_path / "hub")
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn2.yaml"), "--json", env=env)
    assert r.returncode == 0 and "planning with the built-in gpt-oss-120b config" in r.stderr
    assert json.loads(r.stdout)["ranks"] == 128


def test_plan_cli_tables_and_errors():
    r = run_cli("plan", str(RECIPES / "tiny-topology-trn2.yaml"))
    assert r.returncode == 0 and "expert_gate_up_weights" in r.stdout and "DMA offset check" in r.stdout
    r = run_cli("plan", str(RECIPES / "tiny-topology-trn2.yaml"), "--set", "topology.tpp=4")
    assert r.returncode == 1 and "did you mean 'topology.tp'" in r.stderr
