"""Dense (bf16/fp32) checkpoints as a file format: what ``gkbuild synth --dtype`` writes, what the
reader and ``gkbuild inspect`` make of it, and the ways a dense checkpoint can be wrong (mixed,
half converted, a tensor in the wrong dtype, a config that says MXFP4, a non-finite expert), each
refused in one line naming a tensor."""

import hashlib
import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from gkbuild.checkpoint import names
from gkbuild.checkpoint.quantize import quantize
from gkbuild.checkpoint.mxfp4 import decode
from gkbuild.checkpoint.quantized import as_float32, to_bf16_bits
from gkbuild.checkpoint.reader import INDEX, SINGLE, Checkpoint
from gkbuild.checkpoint.safetensors_io import SafetensorsWriter, TensorSpec
from gkbuild.checkpoint.source import parse, synth_cache_dir
from gkbuild.checkpoint.synth import synthesize
from gkbuild.errors import GkError
from gkbuild.model import preset
from tests.conftest import run_cli

CFG = preset("tiny")
L1 = "model.layers.1."


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The tiny preset in each layout, seed 0 (tiny_ckpt is sharded: these are single-file)."""
    root = tmp_path_factory.mktemp("dense")
    return {dt: synthesize(CFG, root / dt, seed=0, dtype=dt) for dt in ("mxfp4", "bf16", "fp32")}


def test_the_mxfp4_synth_bytes_are_unchanged(dense):
    """Pinned at 0b0a67e, before dense synthesis existed: synth:// sources, their caches and the
    goldens computed from them stay valid."""
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in dense["mxfp4"].iterdir()}
    assert digest["model-00001-of-00001.safetensors"] == "8e5968e6a16442f1"
    assert digest["config.json"] == "47ae45e73b930c47"
    assert digest[INDEX] == "c0894d9a73c0d505"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dense_synth_is_transformers_layout_and_detected(dense, dtype):
    ck = Checkpoint.open(dense[dtype])
    assert ck.layout == dtype and not ck.extras
    assert {n: (i.dtype.name, i.shape) for n, i in ck.where.items()} == \
        {s.name: (s.dtype, s.shape) for s in names.expected_specs(CFG, dtype)}
    cfg = json.loads((dense[dtype] / "config.json").read_text())
    assert "quantization_config" not in cfg  # as transformers saves a dequantized model
    assert cfg["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    assert (dense[dtype] / "tokenizer.json").is_file()


def test_every_tensor_but_the_experts_equals_the_mxfp4_synth(dense):
    mx, bf, fp = (Checkpoint.open(dense[d]) for d in ("mxfp4", "bf16", "fp32"))
    shared = [n for n in mx.where if not names.mx_expert(n)]
    assert set(shared) == {n for n in bf.where if not names.dense_expert(n)} == \
        {n for n in fp.where if not names.dense_expert(n)}
    for n in shared:
        a = mx.read(n).view(np.uint16)
        assert np.array_equal(a, bf.read(n).view(np.uint16)), n
        assert np.array_equal(as_float32(a), fp.read(n)), n  # fp32: the bf16 value, widened exactly


def test_dense_synth_is_deterministic_per_seed(tmp_path):
    cfg = CFG.with_layers(1)
    a = synthesize(cfg, tmp_path / "a", seed=3, dtype="bf16")
    b = synthesize(cfg, tmp_path / "b", seed=3, dtype="bf16", jobs=1)
    c = synthesize(cfg, tmp_path / "c", seed=4, dtype="bf16")
    w = "model-00001-of-00001.safetensors"
    assert (a / w).read_bytes() == (b / w).read_bytes() != (c / w).read_bytes()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dense_experts_exercise_the_quantizer(dense, dtype):
    """Off every MXFP4 grid, at the MX experts' scale, with all-zero blocks, one-outlier blocks and
    bf16 subnormals; fp32 has bits below bf16's."""
    ck, mx = Checkpoint.open(dense[dtype]), Checkpoint.open(dense["mxfp4"])
    for proj, fan_in in (("gate_up_proj", CFG.H), ("down_proj", CFG.I)):
        w = as_float32(ck.read(L1 + "mlp.experts." + proj))  # [E, in, out]
        x = np.ascontiguousarray(w.transpose(0, 2, 1))  # the quantizer's [E, out, in]
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        amax = np.abs(blocks).max(-1)
        assert 0.02 < (amax == 0).mean() < 0.2  # all-zero blocks
        sub = (blocks != 0) & (np.abs(blocks) < 2.0 ** -126)
        assert 0.02 < sub.all(-1).mean() < 0.2 and sub.any(-1).mean() > sub.all(-1).mean()  # subnormals
        rest = np.sort(np.abs(blocks), -1)
        assert 0.02 < ((rest[..., -1] >= 4 * rest[..., -2]) & (rest[..., -2] > 2 ** -100)).mean() < 0.2  # outliers
        b, s = quantize(x.astype(np.float32), "round_up")
        assert (decode(b, s) != x).mean() > 0.5  # most values are on no MXFP4 grid
        ours = np.sqrt(np.mean(x ** 2))
        theirs = np.sqrt(np.mean(decode(mx.read(L1 + "mlp.experts." + proj + "_blocks"),
                                        mx.read(L1 + "mlp.experts." + proj + "_scales")) ** 2))
        assert 0.5 < ours / theirs < 2.0, (ours, theirs, fan_in)
        if dtype == "fp32":
            assert (w.view(np.uint32) & 0xFFFF).any()
        else:
            assert ck.where[L1 + "mlp.experts." + proj].dtype.name == "bf16"


def test_synth_uri_names_the_dtype_and_keys_its_cache_only_when_dense():
    mx, bf = parse("synth://tiny?layers=2&seed=0&dtype=mxfp4"), parse("synth://tiny?seed=0&dtype=bf16")
    assert mx.uri == "synth://tiny?layers=2&seed=0" and mx.dtype == "mxfp4"  # as before dense synthesis
    assert bf.uri == "synth://tiny?layers=2&seed=0&dtype=bf16" and bf.describe()["dtype"] == "bf16"
    assert synth_cache_dir(mx).name == "tiny-L2-s0-v2"
    assert synth_cache_dir(bf).name == "tiny-L2-s0-bf16-v2"
    with pytest.raises(GkError, match="synth dtype must be one of mxfp4, bf16, fp32"):
        parse("synth://tiny?dtype=fp16")


@pytest.mark.parametrize("dtype,text", [("mxfp4", "mxfp4 (the hub's"), ("bf16", "bf16 (dense"), ("fp32", "fp32 (dense")])
def test_inspect_names_the_layout(dense, dtype, text):
    r = run_cli("inspect", str(dense[dtype]), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layout"] == dtype
    r = run_cli("inspect", str(dense[dtype]))
    assert r.returncode == 0 and "layout" in r.stdout and text in r.stdout, r.stdout


def _one_file(folder, tensors: dict, config: dict | None = None) -> None:
    """Rewrite ``folder`` as one model.safetensors holding ``tensors`` (name -> array)."""
    for p in folder.glob("model*"):
        p.unlink()
    specs = [TensorSpec(n, {"uint8": "u8", "float32": "fp32"}.get(a.dtype.name, "bf16"), a.shape)
             for n, a in tensors.items()]
    with SafetensorsWriter(folder / SINGLE, specs) as w:
        for n, a in tensors.items():
            w.write(n, np.ascontiguousarray(a))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def _tensors(folder) -> dict:
    ck = Checkpoint.open(folder)
    return {n: np.array(ck.read(n)) for n in ck.where}


def _refused(folder, *words, deep=False):
    r = run_cli("inspect", str(folder), *(["--deep", "-q"] if deep else []))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("gkbuild: error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def bf16_copy(dense, tmp_path):
    shutil.copytree(dense["bf16"], tmp_path / "ck")
    return tmp_path / "ck"


def test_a_mixed_checkpoint_is_refused_naming_a_tensor_of_each(dense, bf16_copy):
    """Layer 1 MXFP4, layer 0 dense: a conversion stopped half way."""
    t, mx = _tensors(bf16_copy), _tensors(dense["mxfp4"])
    for proj in names.PROJS:
        del t[L1 + "mlp.experts." + proj]
        for part in names.MX_PARTS:
            t[L1 + "mlp.experts." + proj + part] = mx[L1 + "mlp.experts." + proj + part]
    _one_file(bf16_copy, t)
    _refused(bf16_copy, "mixed checkpoint", "model.layers.0.mlp.experts.down_proj is a dense expert",
             "model.layers.1.mlp.experts.down_proj_blocks is MXFP4")


def test_gate_up_dense_and_down_proj_mxfp4_is_refused(dense, bf16_copy):
    t, mx = _tensors(bf16_copy), _tensors(dense["mxfp4"])
    for layer in range(CFG.L):
        p = f"model.layers.{layer}.mlp.experts.down_proj"
        del t[p]
        t[p + "_blocks"], t[p + "_scales"] = mx[p + "_blocks"], mx[p + "_scales"]
    _one_file(bf16_copy, t)
    _refused(bf16_copy, "mixed checkpoint", "gate_up_proj is a dense expert", "down_proj_blocks is MXFP4")


def test_a_dense_tensor_in_the_wrong_dtype_is_refused_naming_it(bf16_copy):
    t = _tensors(bf16_copy)
    t[L1 + "mlp.router.weight"] = as_float32(t[L1 + "mlp.router.weight"])
    _one_file(bf16_copy, t)
    _refused(bf16_copy, "tensor model.layers.1.mlp.router.weight is fp32[8, 960], expected bf16[8, 960]")


def test_an_fp32_checkpoint_with_a_bf16_norm_is_refused_naming_it(dense, tmp_path):
    shutil.copytree(dense["fp32"], tmp_path / "ck")
    t = _tensors(tmp_path / "ck")
    t[names.FINAL_NORM] = to_bf16_bits(t[names.FINAL_NORM]).view(ml_dtypes.bfloat16)
    _one_file(tmp_path / "ck", t)
    _refused(tmp_path / "ck", f"tensor {names.FINAL_NORM} is bf16[960], expected fp32[960]")


@pytest.mark.parametrize("value,what", [(0x7F80, "infinity"), (0xFFC1, "NaN")])
def test_a_non_finite_dense_expert_is_refused_naming_it(bf16_copy, value, what):
    t = _tensors(bf16_copy)
    w = t[L1 + "mlp.experts.gate_up_proj"].view(np.uint16)
    w[3, 100, 7] = value
    _one_file(bf16_copy, t)
    line = _refused(bf16_copy, "tensor model.layers.1.mlp.experts.gate_up_proj", "non-finite bf16", deep=True)
    assert f"first at flat index {3 * CFG.H * 2 * CFG.I + 100 * 2 * CFG.I + 7}" in line, what
    with pytest.raises(GkError, match="gate_up_proj.*non-finite"):  # a build reads it the same way
        Checkpoint.open(bf16_copy).read(L1 + "mlp.experts.gate_up_proj", 3, 4)


def test_a_config_that_contradicts_the_tensors_is_refused_naming_one(dense, bf16_copy, tmp_path):
    cfg = json.loads((bf16_copy / "config.json").read_text())
    cfg["quantization_config"] = CFG.to_hf()["quantization_config"]
    (bf16_copy / "config.json").write_text(json.dumps(cfg))
    _refused(bf16_copy, "quantization_config says MXFP4", "model.layers.0.mlp.experts.down_proj is a dense bf16")
    mx = tmp_path / "mx"
    shutil.copytree(dense["mxfp4"], mx)
    cfg = json.loads((mx / "config.json").read_text())
    del cfg["quantization_config"]
    (mx / "config.json").write_text(json.dumps(cfg))
    _refused(mx, "no quantization_config", "model.layers.0.mlp.experts.down_proj_blocks is MXFP4")
