"""Checkpoints that lie: headers with odd types, non-finite bf16 weights, folders for files."""

import json
import struct

import numpy as np
import pytest

from gkbuild import recipe
from gkbuild.checkpoint import names
from gkbuild.checkpoint.reader import Checkpoint
from gkbuild.checkpoint.safetensors_io import read_header
from gkbuild.errors import GkError
from tests.conftest import run_cli


def _file(tmp_path, header: dict, data: bytes = b"\0" * 4):
    raw = json.dumps(header).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return p


def test_metadata_that_is_not_a_map_is_refused(tmp_path):
    p = _file(tmp_path, {"__metadata__": [1], "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    with pytest.raises(GkError, match=r"x.safetensors: corrupt safetensors header: __metadata__ is not a map"):
        read_header(p)


def test_a_fractional_shape_is_refused_not_truncated(tmp_path):
    p = _file(tmp_path, {"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})
    with pytest.raises(GkError, match=r"x.safetensors: tensor 't': malformed header entry"):
        read_header(p)


def test_a_folder_where_a_weight_file_should_be(tmp_path):
    (tmp_path / "w.safetensors").mkdir()
    with pytest.raises(GkError, match=r"w.safetensors: is a folder, not a safetensors file"):
        read_header(tmp_path / "w.safetensors")


def test_nan_in_bf16_weights_stops_compile_before_the_manifest(tiny_copy, tmp_path):
    ck = Checkpoint.open(tiny_copy)
    info = ck.info(names.layer_prefix(1) + "self_attn.q_proj.weight")
    ck.close()
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 2 * 17)
        f.write(np.array([0x7FC0], dtype=np.uint16).tobytes())  # a bf16 NaN
    (tmp_path / "r.yaml").write_text(f"source: {tiny_copy}\ntarget: cpu\nkv_cache: {{num_blocks: 8}}\n")
    r = run_cli("compile", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "out"), "-q", "--no-compile", "-j", "1")
    assert r.returncode == 1
    assert "self_attn.q_proj.weight" in r.stderr and "non-finite bf16 value(s) (NaN or infinity), first at flat " \
                                                    "index 17" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_folder_source_is_recorded_as_written(tiny_ckpt, tmp_path):
    """source.uri is what the recipe says, never this machine's absolute path."""
    from gkbuild.pipeline.pipeline import compile_build
    import shutil

    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    (tmp_path / "r.yaml").write_text("source: ck\ntarget: cpu\nkv_cache: {num_blocks: 8}\n")
    res = compile_build(recipe.load(tmp_path / "r.yaml"), out=tmp_path / "out", quiet=True, compile=False)
    assert res.manifest["source"]["uri"] == "ck"
    assert str(tmp_path) not in (tmp_path / "out" / "manifest.json").read_text()


def test_an_index_that_is_a_folder_is_one_line(tiny_copy):
    (tiny_copy / "model.safetensors.index.json").unlink()
    (tiny_copy / "model.safetensors.index.json").mkdir()
    with pytest.raises(GkError, match=r"model.safetensors.index.json: not a safetensors index \(a folder"):
        Checkpoint.open(tiny_copy)
