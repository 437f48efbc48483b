"""A dense (bf16) tiny fine-tune end to end: its build quantizes the experts by the recipe's scale
rule, verifies tightly against the MXFP4 reference of its golden, and the report states apart the
quantization's own effect and the build's distance to the dense original (--quant-tolerance gates
the latter). The expert shards, and only they, follow the scale rule in the build's cache."""

import json
import re
import shutil

import pytest
import torch

from gkbuild import recipe, reference, verify
from gkbuild.checkpoint.source import materialize, parse
from gkbuild.errors import GkError
from gkbuild.golden import Golden, for_checkpoint
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.pipeline.state import State, stat_of
from gkbuild.reference import KvFormat
from tests.conftest import RECIPES, ROOT, run_cli
from tests.dense import densify

pytestmark = pytest.mark.usefixtures("one_thread")
SOURCE = "synth://tiny?layers=2&seed=0"
DENSE = SOURCE + "&dtype=bf16"  # the same model with bf16 experts off the MXFP4 grid (synth --dtype bf16)
IDS = [[11, 402, 7, 3050, 99, 1234, 5, 870, 2222, 64, 3, 4000], [8, 16, 2048, 17, 300, 1, 999, 42, 3333, 77, 500, 6]]


def _build(source, out, rule: str = "round_up"):
    r = recipe.load(RECIPES / "tiny-cpu.yaml", [f"source={source}", f"quantize.scale_rule={rule}"])
    return compile_build(r, out=out, quiet=True, compile=False)


@pytest.fixture(scope="module")
def dense():
    return materialize(parse(DENSE))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(DENSE, tmp_path_factory.mktemp("b") / "b").out


@pytest.fixture(scope="module")
def golden(dense, tmp_path_factory):
    """Forced over IDS (prompt 4, continuation 8): the MXFP4 reference and the original, one pass each."""
    g = for_checkpoint(dense, [s[:4] for s in IDS], 0, KvFormat("bf16"), continuations=[s[4:] for s in IDS])
    path = tmp_path_factory.mktemp("g") / "g.safetensors"
    g.save(path)
    return path


def test_an_on_grid_dense_source_is_its_mxfp4_one_and_the_original_is_the_dense_math(tmp_path):
    """Dense experts exactly on the MXFP4 grid: quantizing them again gives the MXFP4 checkpoint's
    own reference bit for bit, and the dense original (x @ w + b) the same numbers to rounding."""
    src = materialize(parse(SOURCE))
    exact = densify(src, tmp_path / "exact")
    kv = KvFormat("bf16")
    mx = reference.run(src, IDS, 0, kv)["logits"]
    assert torch.equal(reference.run(exact, IDS, 0, kv)["logits"], mx)
    info = {}
    original = reference.run(exact, IDS, 0, kv, rule=None, info=info)["logits"]
    assert info == {"source_layout": "bf16"}
    torch.testing.assert_close(original, mx, rtol=1e-5, atol=1e-4)


def test_the_golden_of_a_dense_source_holds_the_original_over_the_same_tokens(golden):
    g = Golden.load(golden)
    assert g.meta["quantize"] == {"scale_rule": "round_up", "source_layout": "bf16"}
    assert g.token_ids.tolist() == IDS and g.original_logits.shape == g.logits.shape == (2, 12, 4096)
    assert not torch.equal(g.original_logits, g.logits)  # off the grid: the quantization moves the logits
    old = Golden.load(ROOT / "goldens" / "tiny.safetensors")  # a checked-in MXFP4 golden reads as before
    assert old.original_logits is None and "quantize" not in old.meta


def test_a_damaged_original_is_refused(golden, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(golden), framework="pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for name, bad, said in (("nan", t["original_logits"].clone().index_fill_(2, torch.tensor([3]), float("nan")),
                             "original_logits holds NaN"),
                            ("short", t["original_logits"][:, :-1].contiguous(), "original_logits is [2, 11, 4096]")):
        path = tmp_path / f"{name}.safetensors"
        save_file({**t, "original_logits": bad}, str(path), metadata=meta)
        with pytest.raises(GkError, match=re.escape(said)):
            Golden.load(path)


def test_a_dense_build_verifies_tightly_and_reports_the_quantization(built, golden):
    m = json.loads((built / "manifest.json").read_text())
    assert m["source"]["layout"] == "bf16" and m["source"]["quantize"]["scale_rule"] == "round_up"
    rep = verify.run(built, golden=golden)
    assert rep.ok and rep.kv == "tight", rep.failure()
    q = rep.to_dict()["quantization"]
    ref, ours = q["reference"], q["build"]
    for s in (ref, ours):
        assert s["positions"] == 24 and all(v is not None and v >= 0 for v in (s["mean_kl"], s["p99_kl"], s["max_kl"]))
        assert 0 <= s["top1_agreement"] <= 1
    assert ref["mean_kl"] > 1e-4  # the dense experts hold off-grid values: MXFP4 moves the distribution
    assert ours["mean_kl"] == pytest.approx(ref["mean_kl"], rel=0.05)  # the build is its reference, to rounding
    assert q["ok"] and q["tolerance"] is None and q["scale_rule"] == "round_up"


def test_quant_tolerance_0_fails_in_one_line(built, golden):
    r = run_cli("verify", str(built), "--golden", str(golden), "--quant-tolerance", "0", "-q")
    assert r.returncode == 1
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("gkbuild: error:")]
    assert len(lines) == 1 and lines[0] == r.stderr.strip().splitlines()[-1]
    m = re.search(r"the build's mean KL from the bf16 original is ([0-9.e-]+) nats, over --quant-tolerance 0 "
                  r"\(worst: sequence (\d) position (\d+), ", lines[0])
    assert m and float(m[1]) > 0, lines[0]


def test_a_large_quant_tolerance_passes_and_the_report_has_the_section(built, golden, tmp_path):
    from gkbuild import report

    rep = verify.run(built, golden=golden, quant_tolerance=10.0)
    assert rep.ok, rep.failure()
    q = rep.to_dict()["quantization"]
    assert q["ok"] and q["tolerance"] == 10 and q["reference"]["mean_kl"] > 0
    report.write(rep.to_dict(), tmp_path / "r", "verify")
    page = (tmp_path / "r" / "report.html").read_text()
    assert "Quantization (bf16 original vs MXFP4)" in page and "KL from the original and top-1 agreement" in page
    assert f"{q['reference']['mean_kl']:.3g}" in page and f"{q['build']['mean_kl']:.3g}" in page


def test_a_golden_without_the_original_refuses_quant_tolerance(tmp_path):
    from tests.conftest import RECIPES as R

    out = compile_build(recipe.load(R / "tiny-cpu.yaml"), out=tmp_path / "mx", quiet=True, compile=False).out
    with pytest.raises(GkError, match="nothing to measure the quantization against"):
        verify.run(out, golden=ROOT / "goldens" / "tiny.safetensors", quant_tolerance=0.1, other_checkpoint=True)
    with pytest.raises(GkError, match="nothing to measure the quantization against"):
        verify.run(out, quant_tolerance=0.1)  # an MXFP4 source: refused before a golden is computed


def test_the_scale_rule_keys_the_expert_shards_and_a_golden_of_another_rule_is_refused(built, golden, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(built, b)
    assert _build(DENSE, b).shards_written == 0  # the same rule: nothing rewritten
    before = {p: (r["key"], stat_of(b / p)) for p, r in State(b).shards.items()}
    floor = _build(DENSE, b, "floor")
    after = {p: (r["key"], stat_of(b / p)) for p, r in State(b).shards.items()}
    changed = sorted(p for p in before if before[p] != after[p])
    assert changed == sorted(p for p in before if "/expert-" in p) and floor.shards_written == len(changed) > 0
    assert floor.manifest["source"]["quantize"]["scale_rule"] == "floor"
    with pytest.raises(GkError, match="quantization is scale rule round_up, the build's scale rule floor"):
        verify.run(b, golden=golden)
    # a golden computed now from the build's source uses the build's rule: tight again
    rep = verify.run(b, texts=["Once upon a time"], steps=2)
    assert rep.ok and rep.kv == "tight", rep.failure()
    assert rep.quantization["scale_rule"] == "floor" and rep.quantization["reference"]["mean_kl"] > 0


@pytest.mark.slow
def test_a_bf16_tiny_topology_source_builds_and_verifies_tightly_with_its_quantization_report(tmp_path):
    """Done when: a bf16 tiny-topology source (128 ranks) builds, verifies tightly against the MXFP4
    reference of its golden (the trn3 recipe's FP8 KV), and the report holds the quantization's
    numbers."""
    from gkbuild import report
    from gkbuild.model import preset

    src = "synth://tiny-topology?layers=2&seed=0&dtype=bf16"
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml", [f"source={src}"])
    out = compile_build(r, out=tmp_path / "b", quiet=True, compile=False).out
    kv = KvFormat(r.kv_dtype, r.kv_cache.k_scale, r.kv_cache.v_scale)
    ids = [[t % preset('tiny-topology').V for t in s[:8]] for s in IDS]  # its vocabulary is smaller
    g = for_checkpoint(materialize(parse(src)), [s[:4] for s in ids], 0, kv, continuations=[s[4:] for s in ids])
    g.save(tmp_path / "g.safetensors")
    rep = verify.run(out, golden=tmp_path / "g.safetensors", quant_tolerance=10.0)
    assert rep.ok and rep.kv == "tight", rep.failure()
    q = rep.to_dict()["quantization"]
    assert q["reference"]["positions"] == 16 and q["reference"]["mean_kl"] > 1e-4 and q["ok"]
    report.write(rep.to_dict(), tmp_path / "r", "verify")
    page = (tmp_path / "r" / "report.html").read_text()
    assert "Quantization (bf16 original vs MXFP4)" in page and f"{q['build']['mean_kl']:.3g}" in page
