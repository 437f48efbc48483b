"""``gkbuild quantize``: a dense checkpoint written as the hub's MXFP4 one. The output has synth's
MXFP4 layout exactly; transformers loads it and computes what it computes from the dense source
with each expert replaced by its quantization; a transformers-dequantized MXFP4 checkpoint
quantizes back to the same values (the round trip of issue 35's "Done when"); refusals leave
nothing behind."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

from gkbuild.checkpoint import names
from gkbuild.checkpoint.mxfp4 import decode, unpack_codes
from gkbuild.checkpoint.quantized import expert_to_mx, mx_to_expert
from gkbuild.checkpoint.reader import INDEX, Checkpoint
from gkbuild.checkpoint.synth import synthesize
from gkbuild.model import preset
from tests.conftest import run_cli

CFG = preset("tiny")
SHARD = 8 << 20
TOKENS = torch.tensor([[1, 5, 9, 200, 3000, 7, 7, 42]])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    out = {dt: synthesize(CFG, root / dt, seed=0, dtype=dt, max_shard_bytes=SHARD) for dt in ("mxfp4", "bf16", "fp32")}
    for dt in ("bf16", "fp32"):
        r = run_cli("quantize", str(out[dt]), "--out", str(root / f"q-{dt}"), "--max-shard-size", "8MiB", "-q")
        assert r.returncode == 0, r.stderr
        out[f"q-{dt}"] = root / f"q-{dt}"
    return out


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_output_is_synths_mxfp4_layout(ckpts, dtype):
    q, mx = ckpts[f"q-{dtype}"], ckpts["mxfp4"]
    ck = Checkpoint.open(q)
    assert ck.layout == "mxfp4" and not ck.extras
    assert _files(q) == _files(mx)  # weights split as synth splits them, index, config, tokenizer files
    assert json.loads((q / INDEX).read_text()) == json.loads((mx / INDEX).read_text())
    ref = Checkpoint.open(mx)
    for f, h in ck.headers.items():  # same tensors, dtypes, shapes, offsets in each file
        assert {n: (i.dtype.name, i.shape, i.offset) for n, i in h.tensors.items()} == \
            {n: (i.dtype.name, i.shape, i.offset) for n, i in ref.headers[f].tensors.items()}
    cfg, want = json.loads((q / "config.json").read_text()), json.loads((mx / "config.json").read_text())
    assert cfg["quantization_config"] == want["quantization_config"] == CFG.to_hf()["quantization_config"]
    assert cfg["dtype"] == "bfloat16" and cfg["gkbuild_quantize"] == {
        "scale_rule": "round_up", "version": 1, "source_layout": dtype}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (q / name).read_bytes() == (ckpts[dtype] / name).read_bytes()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_non_experts_are_the_sources_bf16_and_experts_its_quantization(ckpts, dtype):
    """The dense synth's non-expert tensors are the MXFP4 synth's values: bf16 as is, fp32 rounded
    back exactly, so they come out byte for byte the MXFP4 synth's."""
    q, mx, src = (Checkpoint.open(ckpts[k], plain=True) for k in (f"q-{dtype}", "mxfp4", dtype))
    for n in mx.where:
        if not names.mx_expert(n):
            assert np.array_equal(q.read(n), mx.read(n)), n
    for layer in range(CFG.L):
        for proj in names.PROJS:
            p = f"model.layers.{layer}.mlp.experts.{proj}"
            b, s = expert_to_mx(src.read(p), "round_up")
            assert np.array_equal(q.read(p + "_blocks"), b) and np.array_equal(q.read(p + "_scales"), s), p


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_transformers_loads_the_output_and_agrees_with_the_quantized_source(ckpts):
    """transformers dequantizes the output (CPU) and gives exactly the logits of the bf16 source
    loaded dense with each expert weight replaced by mx_to_expert(expert_to_mx(w)): the quantized
    values reach transformers through the hub format unchanged."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    got = AutoModelForCausalLM.from_pretrained(str(ckpts["q-bf16"]), dtype=torch.float32,
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    dense = AutoModelForCausalLM.from_pretrained(str(ckpts["bf16"]), dtype=torch.float32).eval()
    assert not getattr(dense.config, "quantization_config", None)  # read as the dense model it is
    before = _logits(dense)
    with torch.no_grad():
        for layer in dense.model.layers:
            for proj in names.PROJS:
                param = getattr(layer.mlp.experts, proj)  # [E, in, out]
                param.copy_(torch.from_numpy(mx_to_expert(*expert_to_mx(param.numpy(), "round_up"))))
    want = _logits(dense)
    assert torch.equal(_logits(got), want)
    assert not torch.equal(before, want)  # the quantization changed the model: this is not vacuous


def _mx_tensors(folder) -> dict:
    ck = Checkpoint.open(folder, plain=True)
    return {n: np.array(ck.read(n)) for n in ck.where}


@pytest.fixture(scope="module")
def dequantized(ckpts, tmp_path_factory):
    """synth's MXFP4 checkpoint dequantized as training does: transformers with
    Mxfp4Config(dequantize=True), then save_pretrained."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    out = tmp_path_factory.mktemp("deq") / "deq"
    m = GptOssForCausalLM.from_pretrained(str(ckpts["mxfp4"]), quantization_config=Mxfp4Config(dequantize=True),
                                          dtype=torch.bfloat16)
    m.save_pretrained(out)
    return out


def test_round_trip_through_transformers_dequantize(ckpts, dequantized, tmp_path):
    """Done when: synth's MXFP4 checkpoint, dequantized as training does (transformers with
    Mxfp4Config(dequantize=True), save_pretrained), quantized back with round_up: every value is
    the original's. The bytes are too, except in the blocks whose largest |e2m1| M is below 4
    (uniform random codes: (6/8)^32, about 1e-4 of the blocks): round_up derives the scale from
    the block max, so such a block comes back k = 1 (M in {2, 3}), 2 (M in {1, 1.5}) or 3 (M = 0.5)
    scale steps lower with every code value 2^k times larger (the same values; quantize.py's
    docstring)."""
    saved = json.loads((dequantized / "config.json").read_text())
    ours = json.loads((ckpts["bf16"] / "config.json").read_text())
    assert "quantization_config" not in saved and saved["dtype"] == ours["dtype"] == "bfloat16"
    assert Checkpoint.open(dequantized).layout == "bf16"  # our reader reads transformers' own output
    r = run_cli("quantize", str(dequantized), "--out", str(tmp_path / "back"), "--scale-rule", "round_up", "-q")
    assert r.returncode == 0, r.stderr
    a, b = _mx_tensors(ckpts["mxfp4"]), _mx_tensors(tmp_path / "back")
    assert set(a) == set(b)
    moved = total = 0
    for n in a:
        if not n.endswith("_blocks"):
            if not n.endswith("_scales"):
                assert np.array_equal(a[n], b[n]), n  # bf16 through transformers and back, as is
            continue
        s = n[:-len("_blocks")] + "_scales"
        assert np.array_equal(decode(a[n], a[s]).view(np.uint32), decode(b[n], b[s]).view(np.uint32)), n
        mag = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)[unpack_codes(a[n]) & 7]
        M = mag.reshape(*a[s].shape, 32).max(-1)
        k = np.select([M >= 4, M >= 2, M >= 1, M > 0], [0, 1, 2, 3], 0)
        assert (M > 0).all()  # (an all-zero block would come back at scale 0)
        assert np.array_equal(b[s].astype(int), np.maximum(a[s].astype(int) - k, 1)), n
        same = k == 0
        assert np.array_equal(a[n][same], b[n][same]), n  # identical bytes wherever M is 4 or 6
        assert not np.array_equal(a[n][~same], b[n][~same]) or not (~same).any()
        moved, total = moved + int((~same).sum()), total + same.size
    print(f"round trip: {moved} of {total} blocks re-scaled (max |e2m1| < 4), every value identical")
    assert 0 < moved < total * 1e-3


def test_the_builds_of_the_original_and_its_round_trip_differ_only_where_the_bytes_may(ckpts, dequantized, tmp_path):
    """Done when: the build from the MXFP4 original and the build from its transformers-dequantized
    bf16 (quantized back by the build, round_up). Not byte for byte, and why: the manifests differ in
    the source they name (files, hashes, layout, quantize; the recipe's source path; the keys
    transformers' save_pretrained adds to config.json, which the manifest's model carries) and so the
    stage keys and the build id, and in the expert shards holding a re-scaled block (the test above:
    same values, another (scale, codes) spelling).
    Every other shard is equal byte for byte, and every expert shard decodes to the same values."""
    from safetensors.numpy import load_file

    from gkbuild.layout import experts_mx
    from gkbuild.layout.dims import Dims
    from tests.conftest import RECIPES

    m = {}
    for name, src in (("original", ckpts["mxfp4"]), ("round trip", dequantized)):
        out = tmp_path / name.replace(" ", "-")
        r = run_cli("compile", str(RECIPES / "tiny-cpu.yaml"), "--set", f"source={src}", "--out", str(out),
                    "--no-compile", "-q")
        assert r.returncode == 0, r.stderr
        m[name] = (out, json.loads((out / "manifest.json").read_text()))
    (a_dir, a), (b_dir, b) = m["original"], m["round trip"]
    assert b["source"]["layout"] == "bf16" and b["source"]["quantize"]["scale_rule"] == "round_up"
    assert "layout" not in a["source"] and a["build_id"] != b["build_id"]
    same = {k for k in a if a[k] == b.get(k)}
    assert set(a) - same == {"source", "files", "build_id", "stages", "recipe", "model"}, set(a) - same
    # the recipe names another source folder; save_pretrained's config.json carries keys synth's does not
    assert {**a["recipe"]["resolved"], "source": None} == {**b["recipe"]["resolved"], "source": None}
    assert {k for k in a["model"].keys() | b["model"].keys() if a["model"].get(k) != b["model"].get(k)} \
        == {"transformers_version", "dtype", "swiglu_alpha"}
    files = [(f, g) for f, g in zip(a["files"], b["files"], strict=True)]
    assert all(f["path"] == g["path"] and f["size"] == g["size"] for f, g in files)
    differ = [f["path"] for f, g in files if f["sha256"] != g["sha256"]]
    assert differ and all(f.get("role") == "expert" for f, g in files if f["path"] in differ), differ
    d = Dims.of(Checkpoint.open(ckpts["mxfp4"]).config, tp=1)
    for path in differ:
        x, y = load_file(str(a_dir / path)), load_file(str(b_dir / path))
        for proj, inverse in (("gate_up", experts_mx.gate_up_inverse), ("down", experts_mx.down_inverse)):
            w, sc, bias = (f"expert_{proj}_weights", f"expert_{proj}_weights_scale", f"expert_{proj}_bias")
            assert np.array_equal(x[bias], y[bias])
            for layer in range(x[w].shape[0]):
                (bx, sx, _), (by, sy, _) = (inverse(d, t[w][layer], t[sc][layer], t[bias][layer], np.float32)
                                            for t in (x, y))
                assert np.array_equal(decode(bx, sx).view(np.uint32), decode(by, sy).view(np.uint32)), (path, proj)


def test_an_mxfp4_source_is_refused_in_one_line(ckpts, tmp_path):
    r = run_cli("quantize", str(ckpts["mxfp4"]), "--out", str(tmp_path / "o"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "already MXFP4" in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


def test_an_existing_out_is_refused_unless_forced(ckpts, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    r = run_cli("quantize", str(ckpts["bf16"]), "--out", str(out), "-q")
    assert r.returncode == 1 and "already exists and is not empty (use --force" in r.stderr
    assert _files(out) == ["keep"]
    r = run_cli("quantize", str(ckpts["bf16"]), "--out", str(out), "--force", "--max-shard-size", "8MiB", "-q")
    assert r.returncode == 0, r.stderr
    assert _files(out) == _files(ckpts["q-bf16"])
    r = run_cli("quantize", str(ckpts["bf16"]), "--out", str(ckpts["bf16"] / "inside"), "-q")
    assert r.returncode == 1 and "overlap" in r.stderr


def test_a_bad_source_leaves_nothing_half_written(ckpts, tmp_path):
    """A non-finite value in the last expert read: the error names it, no OUT, no temp folder."""
    src = tmp_path / "src"
    shutil.copytree(ckpts["bf16"], src)
    ck = Checkpoint.open(src)
    info = ck.info(f"model.layers.{CFG.L - 1}.mlp.experts.down_proj")
    ck.close()
    with open(info.file, "r+b") as f:  # the last expert's last element: +inf
        f.seek(info.offset + info.nbytes - 2)
        f.write(np.uint16(0x7F80).tobytes())
    r = run_cli("quantize", str(src), "--out", str(tmp_path / "o"), "-q")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert re.search(rf"tensor model\.layers\.{CFG.L - 1}\.mlp\.experts\.down_proj\[\d+:{CFG.E}\]: non-finite bf16",
                     lines[0]), lines[0]  # the slice of experts read together, the last one in it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_quantize_reads_a_synth_source_by_range(ckpts, tmp_path):
    """synth://...&dtype=bf16 read by range (never written): the same bytes as from the folder."""
    uri = f"synth://tiny?layers={CFG.L}&seed=0&dtype=bf16"
    r = run_cli("quantize", uri, "--out", str(tmp_path / "o"), "--max-shard-size", "8MiB", "-q",
                env={"GKBUILD_SYNTH_READ": "range"})
    assert r.returncode == 0, r.stderr
    assert _files(tmp_path / "o") == _files(ckpts["q-bf16"])
    for f in ckpts["q-bf16"].iterdir():
        assert (tmp_path / "o" / f.name).read_bytes() == f.read_bytes(), f.name


def test_the_scale_rule_is_the_one_asked_for(ckpts, tmp_path):
    r = run_cli("quantize", str(ckpts["bf16"]), "--out", str(tmp_path / "o"), "--scale-rule", "floor", "-q")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o" / "config.json").read_text())["gkbuild_quantize"]["scale_rule"] == "floor"
    q, src, up = (Checkpoint.open(p, plain=True) for p in (tmp_path / "o", ckpts["bf16"], ckpts["q-bf16"]))
    p = "model.layers.0.mlp.experts.gate_up_proj"
    b, s = expert_to_mx(src.read(p), "floor")
    assert np.array_equal(q.read(p + "_blocks"), b) and np.array_equal(q.read(p + "_scales"), s)
    assert not np.array_equal(q.read(p + "_scales"), up.read(p + "_scales"))
