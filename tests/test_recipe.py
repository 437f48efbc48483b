import pytest
import yaml

from gkbuild import recipe
from gkbuild.errors import GkError
from gkbuild.model import preset
from tests.conftest import RECIPES, run_cli

GOOD = {
    "source": "synth://tiny-topology?layers=2&seed=0",
    "target": "trn2",
    "topology": {"tp": 8, "dp": 16, "ep": 128, "lnc": 1, "vtp": 128, "hops": [8, 16]},
    "kv_cache": {"dtype": "fp8", "packed": True, "block_size": 4, "num_blocks": 80},
    "decode": {"batch_sizes": [128]},
}


def _with(path: str, value):
    d = yaml.safe_load(yaml.safe_dump(GOOD))
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is KeyError:
        node.pop(keys[-1])
    else:
        node[keys[-1]] = value
    return d


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_load(path):
    r = recipe.load(path)
    assert r.name == path.stem
    if r.source.startswith("synth://"):
        from gkbuild.checkpoint.source import model_config, parse

        r.check_against(model_config(parse(r.source)))
    else:
        r.check_against(preset(r.source.split("/")[-1].split("@")[0]))


def test_defaults_and_derived():
    r = recipe.from_dict(GOOD)
    assert r.hops == [8, 16] and r.topology.world == 128
    assert r.kv_dtype == "fp8_e4m3" and r.backend == "neuron"
    assert r.tail.k == 256 and r.experts == "mxfp4"
    r2 = recipe.from_dict(_with("target", "trn3"))
    assert r2.kv_dtype == "fp8_e4m3fn"
    assert r.digest() != r2.digest()
    assert r.output_dir().parts[-2:] == ("artifacts", "build")


@pytest.mark.parametrize("path, value, message", [
    ("topology.tpp", 8, r"unknown key 'topology.tpp' \(did you mean 'topology.tp'\?\)"),
    ("kv_cahce", {}, r"unknown key 'kv_cahce' \(did you mean 'kv_cache'\?\)"),
    ("topology.tp", "8", r"topology.tp: expected int, got str"),
    ("kv_cache.packed", "yes", r"kv_cache.packed: expected bool"),
    ("target", "tpu", r"target: 'tpu' is not one of trn2, trn3, cpu, cuda"),
    ("experts", "fp8", r"experts: 'fp8' is not one of mxfp4, bf16"),
    ("topology.lnc", 2, r"topology.lnc: 2 is not one of 1"),
    ("topology.ep", 64, r"topology.ep: 64 is not valid; the EP group spans every rank"),
    ("topology.hops", [8, 8], r"topology.hops: \[8, 8\] is not valid; hop sizes must multiply to vtp = 128"),
    ("topology.vtp", 64, r"topology.vtp: 64 is not valid; the tail runs on every rank, so vtp must be the world"),
    ("kv_cache.dtype", "bf16", r"kv_cache.packed: True is not valid; packed K is an FP8 layout"),
    ("kv_cache.block_size", 5, r"kv_cache.block_size: 5 is not valid; packed K pairs tokens"),
    ("kv_cache.num_blocks", KeyError, r"give num_blocks, or hbm_per_rank_gib and memory_utilization"),
    ("kv_cache.memory_utilization", 0.9, r"give either num_blocks or hbm_per_rank_gib"),
    ("decode.batch_sizes", [64], r"decode.batch_sizes: 64 is not valid; each batch size must be a multiple"),
    ("source", KeyError, r"missing required key 'source'"),
    ("topology", [1], r"topology: expected a mapping"),
])
def test_bad_recipes_rejected(path, value, message):
    with pytest.raises(GkError, match=message):
        recipe.from_dict(_with(path, value))


@pytest.mark.parametrize("path, value, message", [
    ("topology.tp", 3, None),  # rejected statically (ep != world) before the model is consulted
])
def test_static_before_model(path, value, message):
    with pytest.raises(GkError):
        recipe.from_dict(_with(path, value))


@pytest.mark.parametrize("changes, message", [
    ({"topology": {"tp": 6, "dp": 2, "ep": 12, "vtp": 12}, "decode": {"batch_sizes": [12]}},
     r"topology.tp: 6 does not divide the 64 attention heads; valid: 1, 2, 4, 8, 16, 32, 64"),
    ({"topology": {"tp": 8, "dp": 3, "ep": 24, "vtp": 24}, "decode": {"batch_sizes": [24]}},
     r"topology.ep: 24 does not divide the 128 experts"),
    ({"topology": {"tp": 8, "dp": 16, "ep": 128, "vtp": 128}, "tail": {"k": 5000}},
     r"tail.k: 5000 exceeds the vocabulary of 2048"),
])
def test_impossible_against_the_model(changes, message):
    d = yaml.safe_load(yaml.safe_dump(GOOD))
    for k, v in changes.items():
        d[k] = {**d.get(k, {}), **v}
    d["topology"].pop("hops", None)
    r = recipe.from_dict(d)
    with pytest.raises(GkError, match=message):
        r.check_against(preset("tiny-topology"))


def test_vocab_not_divisible():
    import dataclasses

    r = recipe.from_dict({**GOOD, "topology": {"tp": 1, "dp": 8, "ep": 8, "vtp": 8},
                          "decode": {"batch_sizes": [8]}})
    with pytest.raises(GkError, match="vtp: 8 does not divide the vocabulary of 1001"):
        r.check_against(dataclasses.replace(preset("tiny"), vocab_size=1001))


def test_yaml_errors_are_one_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("source: [unclosed\n")
    with pytest.raises(GkError, match=r"not valid YAML at line"):
        recipe.load(p)
    with pytest.raises(GkError, match="recipe not found"):
        recipe.load(tmp_path / "missing.yaml")


def test_recipe_doc_lists_every_key():
    keys = [k for k, _, _ in recipe.schema_doc()]
    assert "kv_cache.num_blocks" in keys and "topology.hops" in keys and "tail.k" in keys
    r = run_cli("recipe-doc")
    assert r.returncode == 0 and "kv_cache.packed" in r.stdout


def test_batch_groups_follow_the_tail_kernels_rules():
    """G > 1 needs a single hop, whole 128-row lm_head tiles a group, and the receive-layout fold,
    which a vocabulary small enough for one top-k call (tiny-topology's 2,048) does not get."""
    from gkbuild.model import preset
    from gkbuild.plan import make_plan

    topo = RECIPES / "tiny-topology-trn3.yaml"
    one_hop = ["topology.hops=[128]", "topology.a2a_batch_groups=2", "decode.batch_sizes=[256]"]
    with pytest.raises(GkError, match=r"a2a_batch_groups: 2 is refused by the tail kernel at batch 256: the "
                                      r"receive-layout fold is not supported .* vocabulary 2048"):
        make_plan(recipe.load(topo, one_hop), preset("tiny-topology"))
    with pytest.raises(GkError, match="single-hop exchange only"):
        make_plan(recipe.load(topo, ["topology.a2a_batch_groups=2", "decode.batch_sizes=[256]"]),
                  preset("tiny-topology"))
    big = RECIPES / "gpt-oss-120b-trn3.yaml"
    with pytest.raises(GkError, match="whole 128-row lm_head tiles"):
        make_plan(recipe.load(big, one_hop[:2] + ["decode.batch_sizes=[128]"]), preset("gpt-oss-120b"))
    p = make_plan(recipe.load(big, one_hop), preset("gpt-oss-120b"))  # the production geometry is accepted
    assert p.tail["a2a_batch_groups"] == 2


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_plans(path):
    """What ships is what the tool accepts (issue 36: plan refused three of five)."""
    r = run_cli("plan", str(path), "--json")
    assert r.returncode == 0, r.stderr


def test_compile_refuses_what_plan_refuses_before_writing_anything(tmp_path):
    """Without the Neuron SDK too (it used to warn and build): the same one line, what to do at its end."""
    from gkbuild.compile.rules import TRN3_OR_OWN_KERNEL

    args = (str(RECIPES / "tiny-topology-trn3.yaml"), "--set", "target=trn2")
    plan = run_cli("plan", *args)
    comp = run_cli("compile", *args, "--out", str(tmp_path / "b"), "-q")
    streamed = run_cli("compile", *args, "--to", str(tmp_path / "store"), "-q")
    for r in (plan, comp, streamed):
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "refused by nc_matmul_mx" in r.stderr, r.stderr
        assert r.stderr.rstrip().endswith(TRN3_OR_OWN_KERNEL)
    assert not (tmp_path / "b").exists() and not (tmp_path / "store").exists()
