"""Sizes as a user writes them (--max-shard-size, --scratch-limit): ASCII digits, positive, a unit."""

import pytest

from gkbuild.errors import GkError
from gkbuild.units import parse_size
from tests.conftest import RECIPES, run_cli


@pytest.mark.parametrize("text, n", [("4GB", 4 << 30), ("512MB", 512 << 20), ("24MiB", 24 << 20), ("1.5k", 1536),
                                     ("7 B", 7), ("2gib", 2 << 30), ("1T", 1 << 40)])
def test_a_size_with_a_unit_is_read(text, n):
    assert parse_size(text, "--x") == n


@pytest.mark.parametrize("text", ["-1", "-1GiB", "0GiB", "0.0001B", "12", "١٢MiB", "１２MiB", "12 MiB ", "1e3MB",
                                  "nan GB", "inf GB", "GB", "", "1_000MB", "12XB", "+5MB"])
def test_anything_else_is_one_line_naming_the_option(text):
    with pytest.raises(GkError, match=r"^--x: .* is not a size") as e:
        parse_size(text, "--x")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("option, value", [("--scratch-limit", "-1"), ("--scratch-limit", "١٢MiB")])
def test_the_cli_refuses_a_bad_size_before_any_work(tmp_path, option, value):
    r = run_cli("compile", str(RECIPES / "tiny-cpu.yaml"), "--to", str(tmp_path / "s"), option, value, "-q")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and f"{option}: " in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()
    r = run_cli("synth", "tiny", "--out", str(tmp_path / "c"), "--max-shard-size", value)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--max-shard-size: " in r.stderr, r.stderr
    assert not (tmp_path / "c").exists()
