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
    # trn2's FP8 (e4m3 carried as float8_e4m3fn): the layout only, as a trn2 build keeps it (--no-compile)
    compile_build(recipe.load(RECIPES / "tiny-topology-trn3.yaml", ["target=trn2"]), out=out, quiet=True,
                  compile=False)
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
    assert t["router_weights"].data_ptr() == t2["router_weights"].data_ptr()
    # the embedding table is the runtime's, on the host: no rank's device load set has it
    assert "embed_tokens" not in t and "embed_weight" not in t
    host = b.load_host()
    assert set(host) == {"embed_tokens"} and tuple(host["embed_tokens"].shape) == (2048, 512)
    assert host["embed_tokens"].dtype == torch.bfloat16
    # copy-on-write: writing a loaded tensor never touches the file
    before = (built / "weights/tail-v042.safetensors").read_bytes()
    t["lm_head_weight_t"].add_(1)
    assert (built / "weights/tail-v042.safetensors").read_bytes() == before


def test_allocate_kv(built):
    """trn2 FP8: stacked K and V tensors of e4m3 values carried as float8_e4m3fn (the same bits within
    +-240); each layer's entry in the kernel's view."""
    b = Build.open(built)
    kv = b.allocate_kv()
    assert kv.dtype == "fp8_e4m3" and len(kv.allocations) == 2
    assert [tuple(a.shape) for a in kv.allocations] == [(2, 96, 1, 4, 32)] * 2
    assert kv.allocations[0].dtype == torch.float8_e4m3fn  # torch has no IEEE-style e4m3
    k = kv.k(1)
    assert tuple(k.shape) == (96, 1, 2, 32, 2) and k.dtype == torch.float8_e4m3fn
    assert k.data_ptr() == kv.allocations[0].data_ptr() + 96 * 4 * 32  # layer 1's entry, same bytes
    assert kv.v(0).data_ptr() == kv.allocations[1].data_ptr()
    args = kv.arguments()
    assert tuple(args["K_cache"].shape) == (2, 96, 1, 2, 32, 2) and tuple(args["V_cache"].shape) == (2, 96, 1, 4, 32)
    again = type(kv).from_arguments(kv.layout, args)
    assert again.k(1).data_ptr() == k.data_ptr() and again.v(1).data_ptr() == kv.v(1).data_ptr()


@pytest.mark.parametrize("change, kwargs, message", [
    ({"schema_version": 99}, {}, r"schema_version 99 is not supported"),
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
