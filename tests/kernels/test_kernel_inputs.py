"""What a runtime hands the Neuron decode program, built from a real build and a real step of the
driver (``kernel_inputs.decode_given``), fits the manifest's per-rank signature and passes the
published kernel's own assertions (the stand-in of the revision the build targets)."""

import importlib.util
import sys

import pytest
import torch

from gkbuild import recipe
from gkbuild.compile import interface, switches
from gkbuild.errors import GkError
from gkbuild.kernels import kernel_inputs
from gkbuild.kernels.driver import Session
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.runtime import Build
from tests.compile.conftest import FAKE_SDK, LIB_A, LIB_F, STANDINS
from tests.conftest import RECIPES

pytestmark = pytest.mark.slow
DECODE = "src/nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental/gpt_oss/gpt_oss_decode_layer_dp_tp_ep.py"


def _standin(lib, monkeypatch):
    """The library's stand-in decode kernel, imported as a build host imports it."""
    for p in (str(FAKE_SDK), str(STANDINS), str(lib / "src" / "nkilib_src")):
        monkeypatch.syspath_prepend(p)
    for m in [m for m in sys.modules if m.startswith(("nkilib", "standin", "_checks", "_decode"))]:
        monkeypatch.delitem(sys.modules, m)
    module = importlib.import_module("nkilib.models.gpt_oss.c128_giga_kernel.experimental.gpt_oss."
                                     "gpt_oss_decode_layer_dp_tp_ep")
    return module.gpt_oss_decode_mega_kernel


FORMS = {"stacked-host": ([], LIB_A),
         "paired-vocab-fused": (["kv_cache.form=paired", "decode.embedding=vocab", "decode.rope=fused"], LIB_F),
         "stacked-hidden": (["decode.embedding=hidden"], LIB_F)}


@pytest.fixture(scope="module", params=list(FORMS))
def session(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("ki") / request.param
    # one DP replica of the production TP8 (8 ranks, 8 experts each): the same per-rank shapes
    sets = FORMS[request.param][0] + ["topology={tp: 8, dp: 1, ep: 8, lnc: 1, vtp: 8, hops: [8]}",
                                      "decode.batch_sizes=[8]"]
    compile_build(recipe.load(RECIPES / "tiny-topology-trn3.yaml", sets), out=out,
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
    given = kernel_inputs.decode_given(m, rank, tokens, s.controls[rank // m["topology"]["tp"]], s.tensors[rank],
                                       s.kv[rank].arguments(), s.host.get("embed_tokens"))
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
    key = "kv_cache_update_idx_swa" if form.startswith("paired") else "kv_cache_update_idx"
    assert named[key].dtype == torch.uint32 and named["pos_ids"][0, 0].item() == 8.0
    if "vocab" in form:  # TP rank 5 owns rows [5*256, 6*256) of the vocabulary
        want = torch.where((tokens >= 1280) & (tokens < 1536), tokens - 1280, -1).to(torch.int32)
        assert torch.equal(named["embed_ids"], want)
    if "hidden" in form:
        assert torch.equal(named["embed_ids"], tokens.to(torch.int32)) and named["embed_x_shard_ids"].tolist() == [5]
    reads, off, _ = interface.scan_switches(FORMS[form][1])  # the switches as a build host sets them
    for n, v in switches.environment(switches.settings(reads, off, {}, "test")).items():
        monkeypatch.setenv(n, v)
    kernel = _standin(FORMS[form][1], monkeypatch)
    from nki.collectives import ReplicaGroup

    scalars = {k: ReplicaGroup(v) if k.endswith("replica_group") else v for k, v in art["scalars"].items()}
    out = kernel(**named, **scalars)
    assert tuple(out[0].shape) == (1, 512) and len(out) == 3  # x, and the K/V it wrote (write-back on)


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
