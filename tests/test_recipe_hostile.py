"""Recipes written by an attacker or a careless hand: one line naming the key, nothing built."""

import pytest

from gkbuild import recipe
from gkbuild.errors import GkError, shown
from tests.conftest import run_cli

BASE = "source: synth://tiny?layers=2&seed=0\ntarget: cpu\n"
KV = "kv_cache: {num_blocks: 64}\n"


def _load(tmp_path, text: str, name: str = "r.yaml"):
    p = tmp_path / name
    p.write_text(text) if isinstance(text, str) else p.write_bytes(text)
    return recipe.load(p)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("key", ["topology: {hops: *i}", "name: *i", "decode: {batch_sizes: *i}", "tail: {k: *i}"])
def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, key):
    # 9^9 = 387 million elements if expanded; refused at the first alias, in milliseconds
    with pytest.raises(GkError, match=r"YAML aliases \(\*a\) are not allowed") as e:
        _load(tmp_path, BASE + KV + BOMB + key + "\n")
    assert len(str(e.value)) < 200


def test_duplicate_keys_are_refused(tmp_path):
    with pytest.raises(GkError, match=r"line 3: key 'target' is given twice"):
        _load(tmp_path, "source: synth://tiny\ntarget: cpu\ntarget: trn2\n")


@pytest.mark.parametrize("text, message", [
    ("kv_cache: {dtype: fp8, block_size: 4, num_blocks: 64, k_scale: .nan}", r"kv_cache.k_scale: nan is not a finite"),
    ("kv_cache: {dtype: fp8, block_size: 4, num_blocks: 64, v_scale: .inf}", r"kv_cache.v_scale: inf is not a finite"),
    ("kv_cache: {hbm_per_rank_gib: .inf, memory_utilization: 0.9}", r"hbm_per_rank_gib: inf is not a finite"),
    ("decode: {batch_sizes: [1000000000000000]}", r"decode.batch_sizes: .* exceeds the limit of 65536"),
    ("decode: {batch_sizes: [true]}", r"decode.batch_sizes: expected a list of integers, got \[True\]"),
    ("topology: {hops: [true]}", r"topology.hops: expected a list of integers"),
    ("topology: {tp: true}", r"topology.tp: expected int, got bool"),
    ("name: ''", r"name: '' is not valid; a build name is a plain file name"),
    ("name: ../../x", r"name: '../../x' is not valid"),
    ("name: .hidden", r"name: '.hidden' is not valid"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, text, message):
    with pytest.raises(GkError, match=message):
        _load(tmp_path, BASE + ("" if text.startswith("kv_cache") else KV) + text + "\n")


def test_errors_never_print_a_huge_value(tmp_path):
    with pytest.raises(GkError) as e:
        _load(tmp_path, BASE + KV + "name: " + "x" * 100_000 + "\n")
    assert len(str(e.value)) < 300
    assert shown(list(range(10**6))).endswith("...]")


def test_a_non_utf8_recipe_and_a_folder_are_one_line_errors(tmp_path):
    with pytest.raises(GkError, match=r"r.yaml: not UTF-8 text \(byte 8\)"):
        _load(tmp_path, b"source: \xff\xfe\n")
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(GkError, match=r"d.yaml: is a folder, not a recipe file"):
        recipe.load(tmp_path / "d.yaml")


def test_the_cli_exits_1_with_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "r.yaml").write_text(BASE + KV + BOMB + "name: *i\n")
    r = run_cli("compile", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "out"), "-q", "--no-compile")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "YAML aliases" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_batch_sizes_given_twice_or_too_many_are_refused_at_once(tmp_path):
    """100,000 copies of one batch size were parsed (2.4 s of YAML) and planned; a recipe of more
    than 4096 values is refused as it is parsed, and batch sizes twice or past 64 before planning."""
    from gkbuild.plan import make_plan
    from gkbuild.model import preset

    with pytest.raises(GkError, match=r"decode.batch_sizes: 4 is not valid; each batch size once"):
        _load(tmp_path, BASE + KV + "decode: {batch_sizes: [1, 4, 4]}\n").validate()
    with pytest.raises(GkError, match=r"decode.batch_sizes: .* is not valid; at most 64 batch sizes .*, not 1000"):
        _load(tmp_path, BASE + KV + "decode: {batch_sizes: [" + ", ".join(["4"] * 1000) + "]}\n").validate()
    r = run_cli("plan", str(tmp_path / "r.yaml"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "at most 64 batch sizes" in r.stderr
    with pytest.raises(GkError, match=r"r.yaml: line 4: more than 4096 values; a recipe holds a few dozen"):
        _load(tmp_path, BASE + KV + "decode: {batch_sizes: [" + ", ".join(["4"] * 100_000) + "]}\n")
    ok = _load(tmp_path, BASE + KV + "decode: {batch_sizes: [" + ", ".join(str(b) for b in range(1, 65)) + "]}\n")
    assert len(make_plan(ok.validate(), preset("tiny").with_layers(2)).recipe.decode.batch_sizes) == 64
