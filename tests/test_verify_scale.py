"""Golden, build and verify at the real model's widths on this machine: hidden and intermediate
2880 (6 MX tiles of 512 after padding to 3072, 48 pad lanes in each of the 4 lane groups), 64 q /
8 kv heads of 64, with 16 experts and a 2048-token vocabulary so it fits a test (TP8 x DP2 x EP16,
16 ranks, packed FP8 KV as trn2 stores it)."""

import dataclasses

import pytest

from gkbuild import recipe, verify
from gkbuild.checkpoint.synth import synthesize
from gkbuild.golden import for_checkpoint
from gkbuild.layout import hidden
from gkbuild.layout.dims import Dims
from gkbuild.model import preset
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.reference import KvFormat
from tests.conftest import RECIPES

pytestmark = pytest.mark.usefixtures("one_thread")
REAL = preset("gpt-oss-120b")
SMALL = dataclasses.replace(REAL, num_local_experts=16, vocab_size=2048).with_layers(2)
SETS = ["topology.dp=2", "topology.ep=16", "topology.vtp=16", "topology.hops=[16]", "decode.batch_sizes=[16]",
        "decode.max_context=256", "kv_cache.num_blocks=16"]


def test_the_small_preset_takes_the_real_models_index_paths():
    real, small = Dims.of(REAL, tp=8, ep=128, vtp=128), Dims.of(SMALL, tp=8, ep=16, vtp=16)
    for f in ("H", "Hp", "I", "Ip", "P_I", "q", "kv", "d", "q_l", "kv_l", "E_L"):
        assert getattr(small, f) == getattr(real, f), f
    assert small.Hp // 512 == 6 and small.Ip // 512 == 6
    sigma = hidden.sigma(small.Hp).reshape(4, -1)  # lane group g holds sigma[g]
    assert [(g >= small.H).sum() for g in sigma] == [48] * 4


@pytest.mark.slow
def test_golden_build_and_verify_at_real_widths(tmp_path):
    ck = synthesize(SMALL, tmp_path / "ck", seed=0)
    r = recipe.load(RECIPES / "gpt-oss-120b-trn3.yaml", [f"source={ck}", *SETS])
    out = tmp_path / "build"
    compile_build(r, out=out, quiet=True, compile=False)
    golden = for_checkpoint(ck, [[11, 1900, 7, 512]], steps=2, kv=KvFormat("fp8_e4m3fn"))
    rep = verify.run(out, golden=golden)
    assert rep.ok and rep.kv == "tight", rep.to_dict()
    assert rep.max_abs_err <= 0.05 and max(rep.layer_errors) < verify.LAYER_TOL["tight"]
