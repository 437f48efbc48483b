"""What a runtime hands the Neuron decode program, built from a real build and a real step of the
driver, fits the manifest's per-rank signature and passes the published kernel's own assertions
(the stand-in written from its source)."""

import importlib.util
import sys

import pytest
import torch

from gkbuild import recipe
from gkbuild.errors import GkError
from gkbuild.kernels import kernel_inputs
from gkbuild.kernels.driver import Session
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.runtime import Build
from tests.compile.test_neuron_backend import PER_BUFFER, STANDINS
from tests.conftest import RECIPES

pytestmark = pytest.mark.slow


def _standin(root, name):
    """The stand-in decode kernel under a module name of its own (both forms share a path)."""
    sys.path.insert(0, str(STANDINS))  # its _checks
    path = root / "nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental/gpt_oss/gpt_oss_decode_layer_dp_tp_ep.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.gpt_oss_decode_mega_kernel


@pytest.fixture(scope="module", params=["stacked", "per_buffer"])
def session(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("ki") / request.param
    # one DP replica of the production TP8 (8 ranks, 8 experts each): the same per-rank shapes
    sets = [f"kv_cache.form={request.param}", "topology={tp: 8, dp: 1, ep: 8, lnc: 1, vtp: 8, hops: [8]}",
            "decode.batch_sizes=[8]"]
    compile_build(recipe.load(RECIPES / "tiny-topology-trn2.yaml", sets), out=out,
                  quiet=True)  # no Neuron SDK here: the NEFFs are skipped, their signatures recorded
    b = Build.open(out)
    s = Session(b, 8, 16)
    g = torch.Generator().manual_seed(0)
    for _ in range(9):  # to position 8: past the window of 8 and two blocks of 4 (trimmed sliding tables)
        tokens = torch.randint(0, 2048, (8,), generator=g)
        s.step(tokens)
    return request.param, b, s, tokens


def _inputs(b, s, tokens, rank):
    m = b.manifest
    art = next(a for a in m["compile"]["artifacts"] if a["name"] == "decode-b8")
    tp = m["topology"]["tp"]
    x = s.host["embed_tokens"][tokens[rank:rank + 1]].to(torch.bfloat16)  # decode.embedding: host
    given = {"x_shard": x, **s.tensors[rank], **s.kv[rank].arguments(),
             **kernel_inputs.decode_controls(s.controls[rank // tp], s.block, 1,
                                             m["model"]["num_attention_heads"] // tp, rank)}
    return art, given


def test_runtime_inputs_fit_the_signature_and_the_published_kernel(session, monkeypatch):
    form, b, s, tokens = session
    art, given = _inputs(b, s, tokens, 5)
    args = kernel_inputs.assemble(art["inputs"], given, art["name"])
    named = {i["name"]: t for i, t in zip(art["inputs"], args)}
    assert named["rank_id"].item() == 5 and named["k_scale"].item() == 1.0
    ctl = s.controls[0]
    used = int(ctl.pos[0]) // 4 + 1  # position 8: three of the 16 full-table slots live
    assert (named["active_blocks_table"][:, :used] >= 0).all() and (named["active_blocks_table"][:, used:] == -1).all()
    key = "kv_cache_update_idx" if form == "stacked" else "kv_cache_update_idx_swa"
    assert named[key].dtype == torch.uint32 and named["pos_ids"][0, 0].item() == 8.0
    monkeypatch.setenv("VLLM_NEURON_MEGA_KV_UPDATE", "1")
    kernel = _standin(STANDINS if form == "stacked" else PER_BUFFER, f"standin_{form}")
    out = kernel(**named, **art["scalars"])
    assert tuple(out[0].shape) == (1, 512)


def test_a_misfit_is_named_in_one_line(session):
    _, b, s, tokens = session
    art, given = _inputs(b, s, tokens, 0)
    given["kv_cache_update_idx"] = given["kv_cache_update_idx"].to(torch.int64)
    with pytest.raises(GkError, match=r"^decode-b8: input kv_cache_update_idx is int64\[8, 1\], the program takes "
                                      r"uint32\[8, 1\]$"):
        kernel_inputs.assemble(art["inputs"], given, art["name"])
    given["kv_cache_update_idx"] = given["kv_cache_update_idx"].to(torch.uint32)
    del given["rank_id"]
    with pytest.raises(GkError, match="no value for its input 'rank_id'"):
        kernel_inputs.assemble(art["inputs"], given, art["name"])
