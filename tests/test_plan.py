import dataclasses
import json
import math
import shutil

import pytest

from gkbuild import recipe
from gkbuild.errors import GkError
from gkbuild.model import preset
from gkbuild.plan import make_plan, rank_ranges
from tests.conftest import RECIPES, run_cli


def _plan(name, **over):
    r = recipe.load(RECIPES / f"{name}.yaml", [f"{k}={v}" for k, v in over.items()])
    return make_plan(r, preset({"gpt-oss-120b-trn3": "gpt-oss-120b", "gpt-oss-20b-trn3": "gpt-oss-20b"}.get(
        name, "tiny-topology")))


def test_120b_rank0_contract_shapes():
    j = _plan("gpt-oss-120b-trn3").to_json()
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
    assert j["bytes_per_rank"] == sum(s.nbytes for _, s in _plan("gpt-oss-120b-trn3").rank_tensors(0).values())
    assert j["scalars"]["softmax_scale"] == pytest.approx(0.125)
    assert j["scalars"]["up_clamp_upper_limit"] == 8.0


def test_trn3_uses_ocp_fp8():
    assert _plan("gpt-oss-120b-trn3").to_json()["kv"]["dtype"] == "fp8_e4m3fn"
    assert _plan("gpt-oss-120b-trn3", target="trn2").to_json()["kv"]["dtype"] == "fp8_e4m3"


def test_tiny_topology_mirrors_120b_per_rank():
    big, tiny = _plan("gpt-oss-120b-trn3"), _plan("tiny-topology-trn3")
    assert tiny.world == big.world == 128
    assert set(tiny.rank_tensors(0)) == set(big.rank_tensors(0))
    for rank in (0, 77, 127):
        assert (tiny.dims.q_l, tiny.dims.kv_l, tiny.dims.E_L) == (big.dims.q_l, big.dims.kv_l, big.dims.E_L) == \
            (8, 1, 1)
        assert [f.role for f in tiny.files_of(rank)] == ["shared", "attn", "expert", "tail"]
    assert {f.role: len(f.ranks) for f in tiny.files} == {"shared": 128, "attn": 16, "expert": 1, "tail": 1,
                                                          "embed": 128}
    assert [f.path for f in tiny.host_files] == ["weights/embed-host.safetensors"]
    assert len([f for f in tiny.files if f.role == "attn"]) == 8  # DP replicas share one file
    assert tiny.meshes["tp_replica_group"][1] == tuple(range(8, 16))


def test_files_are_unique_and_dedup():
    p = _plan("gpt-oss-120b-trn3")
    assert len({f.path for f in p.files}) == len(p.files) == 1 + 8 + 128 + 128 + 1
    assert p.disk_bytes < p.weight_bytes(0) * p.world


@pytest.mark.parametrize("over, message", [
    ({"topology.tp": 6, "topology.dp": 2, "topology.ep": 12, "topology.vtp": 12, "topology.hops": "[12]",
      "decode.batch_sizes": "[12]"}, r"topology.tp: 6 does not divide the 64 attention heads"),
    ({"topology.tp": 8, "topology.dp": 3, "topology.ep": 24, "topology.vtp": 24, "topology.hops": "[24]",
      "decode.batch_sizes": "[24]"}, r"topology.ep: 24 does not divide the 128 experts"),
    ({"topology.hops": "[4, 16]"}, r"hop sizes must multiply to vtp = 128"),
    ({"kv_cache.num_blocks": "null", "kv_cache.hbm_per_rank_gib": 1.5, "kv_cache.memory_utilization": 0.9},
     r"the KV budget does not fit: 0.78 GiB of device weights per rank leave 0.00 GiB of 0.50 GiB usable "
     r"\(memory_utilization, and a 1.00 GiB device reserve\)"),
    ({"kv_cache.num_blocks": 14564}, r"exceed the uint32 DMA offset cap of 14,563 for the stacked form .*"
                                     r"paired lifts it to 29,127"),
    ({"kv_cache.num_blocks": 29128, "kv_cache.form": "paired"}, r"cap of 29,127 for the paired form \(2\^32 / "
                                                                r"\(18 entries x 8192"),
    ({"kv_cache.form": "per_buffer"}, r"kv_cache.form: per_buffer is seed 000's unpublished fork: no published "
                                      r"kernel takes per-buffer K/V arguments; use paired"),
])
def test_bad_recipes_against_the_real_config(over, message):
    with pytest.raises(GkError, match=message):
        _plan("gpt-oss-120b-trn3", **over)


def test_budget_mode():
    p = _plan("gpt-oss-120b-trn3", **{"kv_cache.num_blocks": "null", "kv_cache.hbm_per_rank_gib": 24,
                                       "kv_cache.memory_utilization": 0.9})
    j = p.to_json()["kv"]
    usable = int(24 * 2**30 * 0.9)  # the 1 GiB reserve fits in the 2.4 GiB memory_utilization leaves
    fit = (usable - p.weight_bytes(0)) // (36 * 2 * 8192)  # stacked: an entry a layer
    assert j["num_blocks"] == min(fit, 14563) and j["budget"]["mode"] == "hbm"
    assert j["budget"]["fits_blocks"] == fit and j["budget"]["capped_by_dma"] == (fit > 14563)
    pb = _plan("gpt-oss-120b-trn3", **{"kv_cache.num_blocks": "null", "kv_cache.hbm_per_rank_gib": 24,
                                        "kv_cache.memory_utilization": 0.9, "kv_cache.form": "paired"})
    per_block = 18 * 2 * 8192  # paired: an entry a layer pair
    assert pb.to_json()["kv"]["num_blocks"] == min((usable - pb.weight_bytes(0)) // per_block, 29127)
    b = pb.to_json()["kv"]["budget"]
    assert b["mode"] == "hbm" and b["usable_bytes"] == usable and b["reserve_bytes"] == 2**30
    assert b["device_bytes"] == pb.weight_bytes(0) + pb.kv.bytes_per_rank + 2**30 <= 24 * 2**30
    assert b["host_bytes"] == 201088 * 3072 * 2  # reported, not charged
    # a reserve larger than what memory_utilization leaves free comes out of the KV
    big = _plan("gpt-oss-120b-trn3", **{"kv_cache.num_blocks": "null", "kv_cache.hbm_per_rank_gib": 24,
                                         "kv_cache.memory_utilization": 0.9, "kv_cache.device_reserve_gib": 4,
                                         "kv_cache.form": "paired"})
    assert big.budget["fits_blocks"] == (20 * 2**30 - big.weight_bytes(0)) // per_block


# gpt-oss-20b-trn2 (the same recipe for trn2) as planned before the embedding left the device (main at 0b55ba7): every rank was
# charged the replicated [201088, 3072] bf16 table, 1.69 GiB of "weights per rank" in all. An entry a
# layer pair (then per_buffer, now paired: the same bytes a block): 49,771 blocks; stacked KV (the
# default): 24,885 blocks fit, capped at 21,845 by the DMA offset.
BLOCKS_BEFORE_20B = {"paired": 49_771, "stacked": 24_885}


@pytest.mark.parametrize("form", ["paired", "stacked"])
def test_budget_on_20b_gains_at_least_the_embedding(form):
    p = _plan("gpt-oss-20b-trn3", **{"kv_cache.form": form})
    embedding = 201088 * 3072 * 2
    b = p.budget
    before, after = BLOCKS_BEFORE_20B[form], b["fits_blocks"]
    assert after - before >= embedding // b["per_block_bytes"], \
        f"{form}: before {before} blocks, after {after} blocks; gained {after - before}, the embedding is " \
        f"{embedding // b['per_block_bytes']} blocks"
    assert p.weight_bytes(0) == 1_811_025_792 - embedding
    # both tensors' uint32 DMA offset binds first (paired: 2^32 / (12 x 8192) = 43,690): the freed HBM
    # stays free
    assert b["capped_by_dma"] and p.kv.num_blocks == b["dma_cap_blocks"] == {"paired": 43_690, "stacked": 21_845}[form]
    assert b["free_bytes"] >= embedding


@pytest.mark.parametrize("name", ["gpt-oss-120b-trn3", "gpt-oss-20b-trn3", "tiny-topology-trn3"])
@pytest.mark.parametrize("placement", ["host", "vocab", "hidden"])
def test_no_rank_loads_the_full_embedding(name, placement):
    p = _plan(name, **{"decode.embedding": placement})
    V, Hp, W, tp = p.dims.V, p.dims.Hp, p.world, p.dims.tp
    for c in p.ranks:
        tensors = p.rank_tensors(c.rank)
        assert "embed_tokens" not in tensors
        assert all(s.shape != (V, Hp) for _, s in tensors.values())
        if placement == "host":
            assert "embed_weight" not in tensors
        else:
            path, spec = tensors["embed_weight"]
            # both split over the TP group (F's prologue sums over tp_replica_group)
            assert spec.shape == ((-(-V // tp), Hp) if placement == "vocab" else (V, Hp // tp))
            assert path == (f"weights/embed-vocab-tp{c.tp}.safetensors" if placement == "vocab"
                            else f"weights/embed-tp{c.tp}.safetensors")
    emb_bytes = {"host": 0, "vocab": -(-V // tp) * Hp * 2, "hidden": V * Hp // tp * 2}[placement]
    mem = p.device_memory(0)
    assert mem["weights_by_role"].get("embed", 0) == emb_bytes
    assert mem["total_bytes"] == mem["weights_bytes"] + mem["kv_bytes"] + mem["reserve_bytes"]
    assert p.host_bytes == (V * Hp * 2 if placement == "host" else 0)
    groups = p.device_memory_groups()
    assert sorted(r for g in groups for r in g["ranks"]) == list(range(W))


def test_fused_inputs_describe_what_the_kernel_takes():
    p = _plan("gpt-oss-120b-trn3", **{"decode.embedding": "vocab", "decode.rope": "fused"})
    got = {i["name"]: i for i in p.fused_inputs(13)}  # rank 13: TP rank 5 of DP replica 1
    assert got["embed_weight"]["shape"] == [25136, 3072]  # ceil(201088 / 8) rows a TP rank
    assert got["embed_weight"]["file"] == "weights/embed-vocab-tp5.safetensors"
    assert got["embed_ids"]["kind"] == "control" and got["embed_ids"]["shape"] == ["B_attn"]
    assert "[125680, 150816)" in got["embed_ids"]["rule"] and "tp_replica_group" in got["embed_ids"]["rule"]
    assert "embed_x_shard_ids" not in got
    assert got["inv_freq"]["shape"] == [32, 1] and got["inv_freq"]["dtype"] == "fp32"
    assert got["inv_freq"]["file"] == "weights/shared.safetensors"
    assert got["rope_concentration"]["value"] == pytest.approx(0.1 * math.log(32) + 1)
    h = {i["name"]: i for i in _plan("gpt-oss-120b-trn3", **{"decode.embedding": "hidden"}).fused_inputs(13)}
    assert h["embed_weight"]["shape"] == [201088, 384] and h["embed_weight"]["file"] == "weights/embed-tp5.safetensors"
    assert h["embed_ids"]["shape"] == ["B_attn"] and "inv_freq" not in h
    assert h["embed_x_shard_ids"]["kind"] == "rank" and "5*T_shard" in h["embed_x_shard_ids"]["rule"]
    assert _plan("gpt-oss-120b-trn3").fused_inputs(0) == []


def test_placements_the_programs_cannot_take_are_refused():
    with pytest.raises(GkError, match=r"decode.embedding: 'vocab' is not valid; the cpu programs take the embedded"):
        recipe.load(RECIPES / "tiny-cpu.yaml", ["decode.embedding=vocab"])
    with pytest.raises(GkError, match=r"decode.rope: 'fused' is not valid"):
        recipe.load(RECIPES / "tiny-cpu.yaml", ["decode.rope=fused"])
    with pytest.raises(GkError, match=r"decode.embedding: 'rows' is not one of host, vocab, hidden"):
        recipe.load(RECIPES / "tiny-topology-trn3.yaml", ["decode.embedding=rows"])
    cfg = dataclasses.replace(preset("tiny"), num_attention_heads=12, num_key_value_heads=3)
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml", [
        "topology={tp: 3, dp: 1, ep: 3, lnc: 1, vtp: 3}", "decode.batch_sizes=[3]", "decode.embedding=hidden"])
    with pytest.raises(GkError, match=r"decode.embedding: hidden: tp 3 does not divide the 1024 padded hidden lanes"):
        make_plan(r, cfg)


def test_plan_cli_against_a_hub_cache(tmp_path):
    """hf:// planning reads only config.json: lay out a cache holding just that file."""
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    snap = tmp_path / "hub" / "models--openai--gpt-oss-120b" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(preset("gpt-oss-120b").to_hf()))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn3.yaml"), "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    j = json.loads(r.stdout)
    assert j["rank_tensors"]["W_qkv"]["shape"] == [36, 3072, 640]
    assert j["kv"]["bytes_per_rank"] == 36 * 2 * 14563 * 8192
    # without the cache: the built-in config, said out loud
    shutil.rmtree(tmp_path / "hub")
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn3.yaml"), "--json", env=env)
    assert r.returncode == 0 and "planning with the built-in gpt-oss-120b config" in r.stderr
    assert json.loads(r.stdout)["ranks"] == 128


def test_plan_cli_tables_and_errors():
    r = run_cli("plan", str(RECIPES / "tiny-topology-trn3.yaml"))
    assert r.returncode == 0 and "expert_gate_up_weights" in r.stdout and "DMA offset check" in r.stdout
    r = run_cli("plan", str(RECIPES / "tiny-topology-trn3.yaml"), "--set", "topology.tpp=4")
    assert r.returncode == 1 and "did you mean 'topology.tp'" in r.stderr


def test_rank_ranges():
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert rank_ranges([8, 7, 0]) == "0, 7-8"
    assert rank_ranges([]) == ""
