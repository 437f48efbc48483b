"""The DI transfer plan: checked against an independent recomputation from kv.json (the 120b
recipe, as `gkbuild di plan` prints it), the packed-K byte order of the published kernel, the SWA
N-1 window, and block pairs turned into byte descriptors."""

import json

import numpy as np
import pytest

from gkbuild.di import plan as di
from gkbuild.errors import GkError
from gkbuild.layout import kv as kvlayout
from tests.conftest import RECIPES, run_cli


@pytest.fixture(scope="module")
def plan_120b():
    """`gkbuild di plan` of the 120b trn2 recipe (TP8 x DP16, stacked packed FP8) and the kv.json
    that recipe's build writes (`gkbuild plan --json` carries the same KvLayout)."""
    r = run_cli("di", "plan", str(RECIPES / "gpt-oss-120b-trn3.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _kv_json(recipe: str, *sets: str) -> dict:
    from gkbuild import recipe as rc
    from gkbuild.model import preset
    from gkbuild.pipeline.pipeline import layout_docs
    from gkbuild.plan import make_plan

    p = make_plan(rc.load(RECIPES / recipe, list(sets)), preset("gpt-oss-120b"))
    return json.loads(json.dumps(layout_docs(p)["layout/kv.json"]))


def test_the_120b_plan_matches_an_independent_recomputation_from_kv_json(plan_120b):
    doc = _kv_json("gpt-oss-120b-trn3.yaml")
    plan = plan_120b
    # recomputed here from kv.json's own fields, with none of gkbuild.di's functions
    L, nb, bl, d, it = doc["num_layers"], doc["num_blocks"], doc["block_size"], doc["head_dim"], doc["itemsize"]
    heads = {int(r): h for r, h in doc["kv_heads_of_rank"].items()}
    K = len({h for hs in heads.values() for h in hs})
    assert (L, nb, bl, d, it, K, len(heads)) == (36, 14563, 128, 64, 1, 8, 128)
    head_bytes = bl * d * it  # 8192: one kv head of one block
    prefill_tp = 4
    per_prefill = K // prefill_tp  # 2 heads a prefill rank
    assert plan["prefill"]["block_len"] == per_prefill * head_bytes == 16384
    assert plan["decode"]["block_len"] == doc["block_bytes"] == 8192
    assert plan["prefill"]["heads_of_rank"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # the prefill engine registers one region a K or V half of each layer pair's buffer
    assert [(r["index"], r["buffer"], r["half"], r["layers"]) for r in plan["prefill"]["regions"]] == \
        [(2 * j + h, j, "KV"[h], [2 * j, 2 * j + 1]) for j in range(18) for h in (0, 1)]
    assert len(plan["ranks"]) == 128
    for r, hs in heads.items():
        rank = plan["ranks"][r]
        assert rank["rank"] == r and rank["kv_heads"] == hs
        assert len(rank["reads"]) == 2 * L
        (h,) = hs
        for i in range(L):
            for half in (0, 1):
                rd = rank["reads"][2 * i + half]
                entry = i  # stacked: entry i holds layer i
                assert (rd["layer"], rd["half"]) == (i, "KV"[half])
                assert rd["group"] == ("swa" if i % 2 == 0 else "full")  # even layers slide
                assert rd["decode_region"] == 2 * entry + half
                assert rd["decode_region_offset"] == entry * nb * head_bytes == doc["di_regions"][2 * entry + half]["offset"]
                assert rd["prefill_region"] == 2 * (i // 2) + half
                assert rd["segments"] == [{"prefill_rank": h // per_prefill, "prefill_offset": (h % per_prefill) * head_bytes,
                                           "decode_offset": 0, "length": head_bytes}]
    assert plan["swa"]["truncate"] is True and "N-1" in plan["swa"]["prefill"] and "N-1" in plan["swa"]["decode"]
    assert plan["window"] == 128 and plan["k_conversion"]["where"].startswith("on the decode side")


def test_the_paired_form_reads_both_layers_of_a_pair_into_one_entry():
    doc = _kv_json("gpt-oss-120b-trn3.yaml", "kv_cache.form=paired", "kv_cache.num_blocks=29127")
    plan = di.transfer_plan(doc, 4, 128)
    assert plan["decode"]["entries"] == 18
    reads = plan["ranks"][5]["reads"]
    for i in range(36):
        for half in (0, 1):
            rd = reads[2 * i + half]
            assert rd["decode_region"] == 2 * (i // 2) + half == rd["prefill_region"]
            assert rd["decode_region_offset"] == (i // 2) * 29127 * 8192
            assert rd["group"] == ("swa" if i % 2 == 0 else "full")
    assert reads[0]["segments"] == [{"prefill_rank": 2, "prefill_offset": 8192, "decode_offset": 0, "length": 8192}]


def test_bf16_has_no_conversion_and_twice_the_bytes():
    doc = _kv_json("gpt-oss-120b-trn3.yaml", "kv_cache.dtype=bf16", "kv_cache.packed=false", "kv_cache.num_blocks=4000")
    plan = di.transfer_plan(doc, 4, 128)
    assert plan["k_conversion"] is None and plan["decode"]["block_len"] == 16384 == plan["prefill"]["block_len"] // 2
    assert plan["ranks"][3]["reads"][0]["segments"] == [
        {"prefill_rank": 1, "prefill_offset": 16384, "decode_offset": 0, "length": 16384}]


@pytest.mark.parametrize("decode_heads,prefill_tp,kv,want", [
    ([2, 3], 4, 8, [(1, 0, 0, 2)]),  # decode holds a whole prefill rank's heads: one read
    ([2, 3, 4, 5], 4, 8, [(1, 0, 0, 2), (2, 0, 2, 2)]),  # decode TP2: two prefill ranks
    ([5], 8, 8, [(5, 0, 0, 1)]),  # same TP
    ([3], 16, 8, [(6, 0, 0, 1)]),  # prefill TP16 replicates each head on 2 ranks: the first is read
    ([0, 1, 2, 3, 4, 5, 6, 7], 1, 8, [(0, 0, 0, 8)]),
])
def test_heterogeneous_tp_segments(decode_heads, prefill_tp, kv, want):
    got = di.segments(decode_heads, prefill_tp, kv, 100)
    assert [(s["prefill_rank"], s["prefill_offset"] // 100, s["decode_offset"] // 100, s["length"] // 100)
            for s in got] == want


def test_a_prefill_tp_the_heads_do_not_split_over_is_refused():
    doc = _kv_json("gpt-oss-120b-trn3.yaml")
    with pytest.raises(GkError, match="8 kv heads split over neither 3 prefill ranks"):
        di.transfer_plan(doc, 3, 128)
    bad = dict(doc, kv_heads_of_rank={"0": [0], "1": ["x"]})
    with pytest.raises(GkError, match=r"kv_heads_of_rank\[1\]"):
        di.transfer_plan(bad, 4, 128)


@pytest.mark.parametrize("n,truncate,want", [
    (10, True, [0, 1, 2]),  # N = 11 = 3 mod 4: the first query (position 10) attends 3..9: blocks 0-2
    (10, False, [1, 2]),  # taken for a query at 11 (no N-1 rule): block 0 (position 3) is lost
    (11, True, [1, 2]),  # N = 12: attends 4..10
    (11, False, [1, 2]),  # the same blocks: only N % block == block - 1 exposes the rule
    (3, True, [0]), (0, True, []),
])
def test_the_swa_window_at_n_minus_1(n, truncate, want):
    assert list(di.window_blocks(n, 4, 8, truncate)) == want


def test_block_pairs_and_descriptors():
    doc = _kv_json("gpt-oss-120b-trn3.yaml", "kv_cache.num_blocks=100")
    plan = di.transfer_plan(doc, 4, 128)
    n = 300  # N = 301: full blocks 0-2; the window (query 300) attends 173..299: blocks 1-2
    mine = {"full": [7, 8, 9], "swa": {1: 8, 2: 9}}  # stacked: the window's ids are the full ids
    theirs = {"full": [40, 41, 42], "swa": {0: 50, 1: 51, 2: 52}}
    pairs = {g: di.block_pairs(g, n, 128, 128, mine, theirs) for g in ("full", "swa")}
    assert pairs["full"].tolist() == [[7, 40], [8, 41], [9, 42]] and pairs["swa"].tolist() == [[8, 51], [9, 52]]
    rows = di.descriptors(plan, 3, pairs)  # rank 3 holds head 3: prefill rank 1, second head
    # 18 sliding layers x 2 halves x 2 blocks + 18 full layers x 2 x 3 blocks
    assert len(rows) == 18 * 2 * 2 + 18 * 2 * 3
    half, doff, prank, preg, poff, ln = rows[0]
    assert (half, prank, preg, ln) == (0, 1, 0, 8192)
    assert doff == 0 * 100 * 8192 + 8 * 8192 and poff == 51 * 16384 + 8192
    layer1_k = rows[(rows[:, 0] == 0) & (rows[:, 1] >= 100 * 8192) & (rows[:, 1] < 2 * 100 * 8192)]
    assert layer1_k[:, 1].tolist() == [100 * 8192 + b * 8192 for b in (7, 8, 9)]
    assert layer1_k[:, 4].tolist() == [b * 16384 + 8192 for b in (40, 41, 42)]
    with pytest.raises(GkError, match="the prefill side holds no swa block for logical block 0"):
        di.block_pairs("swa", 10, 4, 8, {"full": [1, 2, 3], "swa": {0: 1, 1: 2, 2: 3}}, {"full": [4, 5, 6], "swa": {1: 8, 2: 9}})


def _kernel_write(rows_bytes: np.ndarray, slot: int, k: np.ndarray) -> None:
    """The decode kernel's packed-K write, as aws-neuron/nki-library@e9ef98fc's attention_block_tkg
    ``_k_update_fp8_packed`` does it: K_cache viewed as rows of d bf16 (2d bytes), slot s lands in
    row s >> 1, channel c in byte 2c (even s, the low byte) or 2c + 1 (odd s, the high byte)."""
    row = rows_bytes[slot >> 1]
    row[(slot & 1)::2] = k


def test_the_packed_k_bytes_are_the_kernels_and_a_prefill_block_needs_the_conversion():
    rng = np.random.default_rng(0)
    block, d = 8, 4
    k = rng.integers(1, 255, (block, d), dtype=np.uint8)  # one head's block of K, token-major: the prefill's bytes
    kernel = np.zeros((block // 2, 2 * d), dtype=np.uint8)
    for t in range(block):
        _kernel_write(kernel, t, k[t])
    packed = kvlayout.pack_block(k[None])[0]  # what the plan's conversion writes
    assert np.array_equal(np.ascontiguousarray(packed).reshape(-1), kernel.reshape(-1))
    assert not np.array_equal(k.reshape(-1), kernel.reshape(-1))  # copied as they are, the bytes differ
    lay = kvlayout.KvLayout("stacked", 1, 1, 1, block, d, "fp8_e4m3", 1, True)
    assert all(kernel.reshape(-1)[lay.k_offset(0, 0, 0, t, c)] == k[t, c] for t in range(block) for c in range(d))


def test_covering_lengths():
    assert di.covering_lengths(4, 8) == [12, 15]
    assert di.covering_lengths(128, 128) == [256, 383]
    for n in di.covering_lengths(4, 8):
        assert n > 8
    assert [n % 4 for n in di.covering_lengths(4, 8)] == [0, 3]


def test_di_plan_prints_a_build_and_refuses_set_on_one(tmp_path):
    from gkbuild import recipe
    from gkbuild.pipeline.pipeline import compile_build

    out = tmp_path / "b"
    compile_build(recipe.load(RECIPES / "tiny-topology-trn3.yaml"), out=out, quiet=True, compile=False)
    r = run_cli("di", "plan", str(out), "--prefill-tp", "2")
    assert r.returncode == 0, r.stderr
    assert "prefill: TP2, 4 of 8 kv heads a rank" in r.stdout and "SWA N-1 rule (window 8)" in r.stdout
    assert "each received K block is relaid in place" in r.stdout
    r = run_cli("di", "plan", str(out), "--set", "kv_cache.dtype=bf16")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["gkbuild: error: --set applies to a recipe, not to a build"]


def test_blocks_needed_is_the_pools_peak():
    """A DP replica's 8 sequences over 31 positions (blocks of 4, window 8): 8 full blocks each;
    paired adds 3 sliding ones at the peak (the window's 2 and the one being taken). A pool of
    exactly that many runs; one block fewer does not."""
    from gkbuild.kernels.driver import _Blocks, blocks_needed

    for form, want in (("stacked", 8 * 8), ("paired", 8 * (8 + 3))):
        assert blocks_needed(8, 31, 4, 8, form) == want
        for size, fits in ((want, True), (want - 1, False)):
            pool = _Blocks(8, size, 4, 8, form)
            try:
                for pos in range(31):
                    for r in range(8):
                        pool.advance(r, pos)
                ran = True
            except GkError:
                ran = False
            assert ran == fits, (form, size)


@pytest.mark.parametrize("form", ["stacked", "paired"])
@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipes_di_verify_fits_its_kv_budget(path, form):
    """`gkbuild verify BUILD --prefill nixl` with its defaults (prompts of each covering length,
    then --steps' default) fits the KV budget of every shipped recipe in both forms: the check
    every run passes (``driver.check_run``) holds before any transfer."""
    from gkbuild import recipe
    from gkbuild.checkpoint.source import parse, synth_config
    from gkbuild.cli import verify as verify_cmd
    from gkbuild.kernels.driver import check_run
    from gkbuild.model import preset
    from gkbuild.plan import make_plan

    r = recipe.load(path, [f"kv_cache.form={form}"])
    spec = parse(r.source)  # a hub source: the preset of its repo's name (no hub reached)
    cfg = synth_config(spec) if spec.kind == "synth" else preset(spec.uri.split("/")[-1].split("@")[0])
    p = make_plan(r, cfg)
    steps = next(o.default for o in verify_cmd.params if o.name == "steps")
    m = {"scalars": p.scalars, "topology": {"dp": r.topology.dp}, "model": {"sliding_window": cfg.sliding_window}}
    for n in di.covering_lengths(p.kv.block_size, cfg.sliding_window):
        check_run(m, p.kv, max(r.decode.batch_sizes), n + steps)


def _rehashed(built, tmp_path, kv_edit=None, manifest_edit=None):
    """A copy of ``built`` with its kv.json and manifest edited and the manifest re-hashed, as a
    hostile one would be."""
    import hashlib
    import shutil

    from gkbuild.pipeline import manifest as mf

    b = tmp_path / "b"
    shutil.copytree(built, b)
    m = json.loads((b / mf.NAME).read_text())
    if kv_edit:
        kv = json.loads((b / "layout" / "kv.json").read_text())
        kv_edit(kv)
        data = json.dumps(kv).encode()
        (b / "layout" / "kv.json").write_bytes(data)
        f = next(f for f in m["files"] if f["path"] == "layout/kv.json")
        f.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    if manifest_edit:
        manifest_edit(m)
    m["build_id"] = mf.build_id(m)
    (b / mf.NAME).write_text(json.dumps(m))
    return b


def _layers(kv):
    kv["num_layers"] = 100_000
    kv["layers"] = [dict(kv["layers"][i % 2], layer=i) for i in range(100_000)]


@pytest.mark.parametrize("kv_edit, manifest_edit, said", [
    (_layers, None, "kv.json: num_layers is 100000; the manifest's model"),
    (None, lambda m: m["recipe"]["resolved"]["decode"].update(batch_sizes=[1 << 30]),
     "manifest.json: recipe decode.batch_sizes [1073741824]: expected"),
], ids=["kv.json 100000 layers", "manifest batch size 2**30"])
def test_counts_a_build_declares_are_bounded_before_anything_is_sized_from_them(built, tmp_path, kv_edit,
                                                                                 manifest_edit, said):
    """Held to the manifest's model (or to a recipe's bounds) before any per-layer or per-row list
    is derived from them: the held-out kv.json case ran past 120 s, a 2**30 batch allocated GBs."""
    r = run_cli("di", "plan", str(_rehashed(built, tmp_path, kv_edit, manifest_edit)))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr
