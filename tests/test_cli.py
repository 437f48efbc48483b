import json

import pytest

from tests.conftest import run_cli


def test_synth_then_inspect_json(tmp_path):
    out = tmp_path / "ck"
    r = run_cli("synth", "tiny", "--out", str(out), "--layers", "1", "--seed", "7", "-q")
    assert r.returncode == 0, r.stderr
    r = run_cli("inspect", str(out), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["preset"] == "tiny" and s["layers"] == 1 and s["experts"] == 8
    assert s["bytes"] > sum(s["bytes_by_kind"].values())  # file bytes include the headers
    assert s["bytes_by_kind"]["experts (mxfp4)"] > s["bytes_by_kind"]["attention"]
    r = run_cli("inspect", str(out))
    assert r.returncode == 0 and "tiny" in r.stdout and "bytes by tensor kind" in r.stdout


@pytest.mark.parametrize("cmd", [[], ["synth"], ["inspect"], ["recipe-doc"]])
def test_help(cmd):
    r = run_cli(*cmd, "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout


def test_errors_are_one_line(tmp_path):
    r = run_cli("synth", "tinyy", "--out", str(tmp_path / "x"))
    assert r.returncode == 1
    assert r.stderr.strip() == ("gkbuild: error: unknown preset 'tinyy' (did you mean 'tiny'?); presets: "
                                "gpt-oss-120b, gpt-oss-20b, tiny, tiny-topology")
    assert not (tmp_path / "x").exists()
    r = run_cli("inspect", str(tmp_path / "nope"))
    assert r.returncode == 1 and "no such file or folder" in r.stderr
