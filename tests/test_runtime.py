import json
import shutil

import numpy as np
import pytest
import torch

from gkbuild import recipe
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.errors import GkError
from gkbuild.runtime import Build
from tests.conftest import RECIPES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("rt") / "topo"
    compile_build(recipe.load(RECIPES / "tiny-topology-trn2.yaml"), out=out, quiet=True, compile=False)
    return out


def test_load_rank_zero_copy(built):
    b = Build.open(built, target="trn2", world_size=128)
    t = b.load_rank(42)
    assert set(t) == set(b.manifest["ranks"][42]["loads"][0]["tensors"]) | {
        n for x in b.manifest["ranks"][42]["loads"][1:] for n in x["tensors"]}
    assert t["W_qkv"].dtype == torch.bfloat16 and tuple(t["W_qkv"].shape) == (2, 512, 320)
    assert t["expert_gate_up_weights"].dtype == torch.uint16
    assert t["router_weights"].dtype == torch.float16 and t["gamma"].dtype == torch.float32
    # zero-copy: two loads of the shared file see the same pages
    t2 = b.load_rank(7)
    assert t["embed_tokens"].data_ptr() == t2["embed_tokens"].data_ptr()
    # copy-on-write: writing a loaded tensor never touches the file
    before = (built / "weights/tail-v042.safetensors").read_bytes()
    t["lm_head_weight_t"].add_(1)
    assert (built / "weights/tail-v042.safetensors").read_bytes() == before


def test_allocate_kv(built):
    b = Build.open(built)
    kv = b.allocate_kv()
    assert len(kv.buffers) == 1 and tuple(kv.buffers[0].shape) == (2, 80, 1, 4, 32)
    assert kv.buffers[0].dtype == torch.float8_e4m3fn
    k = kv.k(0)
    assert tuple(k.shape) == (80, 1, 2, 32, 2)
    assert k.data_ptr() == kv.buffers[0].data_ptr()  # same bytes
    assert kv.v(0).data_ptr() == kv.buffers[0].data_ptr() + 80 * 4 * 32


@pytest.mark.parametrize("change, kwargs, message", [
    ({"schema_version": 2}, {}, r"schema_version 2 is not supported"),
    ({"name": "renamed"}, {}, r"build_id .* is not the hash of the manifest's content"),
    ({}, {"target": "trn3"}, r"built for target 'trn2', not 'trn3'"),
    ({}, {"world_size": 64}, r"built for 128 ranks \(TP8 x DP16\), this runtime has 64"),
])
def test_refusals(built, tmp_path, change, kwargs, message):
    b = tmp_path / "b"
    shutil.copytree(built, b)
    if change:
        m = json.loads((b / "manifest.json").read_text())
        m.update(change)
        (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(GkError, match=message):
        Build.open(b, **kwargs)


def test_refuses_a_file_that_changed_size(built, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(built, b)
    with open(b / "weights/attn-tp0.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(GkError, match="attn-tp0.safetensors: .* bytes, the manifest says"):
        Build.open(b).load_rank(0)
    assert np is not None
