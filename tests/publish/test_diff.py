"""gkbuild diff: recipe keys, source, tools, files and the ranks those files reach."""

import copy
import json

from gkbuild import recipe
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.publish.diff import diff, load
from gkbuild.publish.publish import publish
from tests.conftest import RECIPES, run_cli


def test_identical_builds(built):
    m = mf.load(built)
    d = diff(m, copy.deepcopy(m))
    assert d["identical"] and not d["recipe"] and not d["files"]["changed"] and d["ranks"]["changed"] == 0


def test_a_recipe_change_names_the_key_the_files_and_the_ranks(build, tmp_path):
    a = mf.load(build)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    b = mf.load(build)
    d = diff(a, b)
    assert not d["identical"]
    assert d["recipe"] == [{"key": "tail.k", "a": 256, "b": 64}]
    assert [c["path"] for c in d["files"]["changed"]] == ["layout/tail.json"]
    assert d["ranks"]["changed"] == 0  # no rank loads different weights
    assert not d["source"] and not d["tools"]


def test_changed_weight_files_name_exactly_the_ranks_that_load_them():
    """On a crafted pair of 128-rank manifests: expert shards 5..7 and 40 changed."""
    def manifest(sha):
        files = [{"path": f"weights/expert-{r:03d}.safetensors", "size": 1, "sha256": sha(r), "role": "expert"}
                 for r in range(128)] + [{"path": "weights/shared.safetensors", "size": 1, "sha256": "s", "role": "shared"}]
        ranks = [{"rank": r, "loads": [{"file": "weights/shared.safetensors"},
                                       {"file": f"weights/expert-{r:03d}.safetensors"}]} for r in range(128)]
        return {"name": "n", "build_id": sha(-1), "recipe": {"resolved": {}}, "source": {"uri": "u", "files": []},
                "tools": {}, "compile": {"status": "ok", "artifacts": []}, "files": files, "ranks": ranks}

    a = manifest(lambda r: "a")
    b = manifest(lambda r: "b" if r in (5, 6, 7, 40, -1) else "a")
    d = diff(a, b)
    assert d["ranks"] == {"changed": 4, "of": 128, "which": "5-7, 40"}
    assert len(d["files"]["changed"]) == 4


def test_cli_diff_of_a_build_and_a_store(build, tmp_path):
    publish(build, str(tmp_path / "store"), quiet=True)
    assert load(str(tmp_path / "store"))["build_id"] == mf.load(build)["build_id"]
    r = run_cli("diff", str(build), str(tmp_path / "store"))
    assert r.returncode == 0 and "identical builds" in r.stdout
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    r = run_cli("diff", str(tmp_path / "store"), str(build), "--json")
    assert r.returncode == 1, r.stderr
    d = json.loads(r.stdout)
    assert d["recipe"] == [{"key": "tail.k", "a": 256, "b": 64}]
    r = run_cli("diff", str(build), str(tmp_path / "nothing"))
    assert r.returncode == 1 and r.stderr.startswith("gkbuild: error:") and "no such build folder or store" in r.stderr


def test_names_from_a_manifest_reach_the_terminal_shown_not_obeyed(built, build, monkeypatch, capsys):
    """A recipe value from a (hostile) manifest with terminal escapes or rich markup (paths are
    held to the schema's characters)."""
    from gkbuild import cli

    m = mf.load(build)
    m["recipe"]["resolved"]["source"] = "\x1b]0;owned\x07[red]x"
    m["recipe"]["resolved"]["\x1b[2J[bold]n"] = 1
    m["build_id"] = mf.build_id(m)
    mf.write(build / mf.NAME, m)
    monkeypatch.setattr(cli, "out", cli.Console(width=300, force_terminal=True))  # as on a terminal
    try:
        cli.main(["diff", str(built), str(build)])
    except SystemExit:
        pass
    shown = capsys.readouterr().out
    assert "\x07" not in shown and "\x1b]0" not in shown and "\x1b[2J" not in shown
    assert "\\u001b]0;owned\\u0007[red]x" in shown and "\\x1b[2J[bold]n" in shown  # JSON's escapes, and ours
