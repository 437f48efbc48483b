"""The GitHub Actions workflow: it parses, runs compile -> verify (stored golden) -> check ->
publish in that order, every gkbuild command in it is valid for this CLI, and the defaults it
names exist and pass (the stored golden still verifies the default recipe's build)."""

import os
import re
import shlex
from pathlib import Path

import click
import yaml

from gkbuild import recipe
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.cli import cli
from gkbuild.verify import run as verify_run
from gkbuild.golden import Golden
from tests.conftest import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "build-artifacts.yml"


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _commands(wf: dict, job: str = "build") -> list[list[str]]:
    """Every gkbuild invocation in the job's run steps, env references filled with sample values."""
    job = wf["jobs"][job]
    env = {"RECIPE": "recipes/tiny-cpu.yaml", "GOLDEN": "goldens/tiny.safetensors", "OUT": "artifacts/x",
           "HUB_REPO": "org/name", "BRANCH": "build-1", "NEFF": "--require-neff",
           "SIGNER": "https://github.com/org/gk/.github/workflows/build-artifacts.yml@refs/tags/build-1"}
    cmds = []
    for step in job["steps"]:
        for line in step.get("run", "").splitlines():
            line = line.split(">")[0].split(";;")[0].strip()
            if ".venv/bin/gkbuild" in line:
                line = re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], line[line.index(".venv/bin/gkbuild"):])
                cmds.append(shlex.split(line)[1:])
    return cmds


def test_the_workflow_builds_verifies_checks_then_publishes_on_a_tag():
    wf = _workflow()
    on = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as true
    assert on["push"]["tags"] == ["build-*"]
    cmds = _commands(wf)
    assert [c[0] for c in cmds] == ["compile", "verify", "check", "publish"]
    assert "--golden" in cmds[1] and cmds[3][cmds[3].index("--to") + 1].startswith("hf://")
    steps = wf["jobs"]["build"]["steps"]
    assert "secrets.HF_TOKEN" in wf["jobs"]["build"]["env"]["HF_TOKEN"]
    assert any(s.get("run", "").strip() == "make install" for s in steps)


def test_the_trainium_job_fetches_the_published_build_and_verifies_its_neffs():
    wf = _workflow()
    job = wf["jobs"]["verify-on-trainium"]
    assert job["needs"] == "build" and "GKBUILD_TRAINIUM_RUNNER" in job["runs-on"]
    cmds = _commands(wf, "verify-on-trainium")
    assert [c[0] for c in cmds] == ["fetch", "verify"] and cmds[1][cmds[1].index("--engine") + 1] == "neuron"
    # the build job needs no NeuronCore: it installs the SDK for trn recipes and traces on the host
    assert any("gkbuild[neuron]" in s.get("run", "") or ".[neuron]" in s.get("run", "")
               for s in wf["jobs"]["build"]["steps"])


def test_the_build_is_signed_keyless_by_the_runner_and_the_fetching_job_trusts_that_identity():
    wf = _workflow()
    assert wf["permissions"]["id-token"] == "write"  # the runner may ask GitHub for its OIDC token
    publish = _commands(wf)[3]
    assert publish[publish.index("--sign") + 1] == "sigstore"
    job = wf["jobs"]["verify-on-trainium"]
    fetch = _commands(wf, "verify-on-trainium")[0]
    assert fetch[fetch.index("--trust") + 1] == "https://github.com/org/gk/.github/workflows/build-artifacts.yml@" \
                                                 "refs/tags/build-1"
    # the identity Sigstore certifies for a GitHub workflow: its file at the ref it ran for
    assert job["env"]["SIGNER"] == ("https://github.com/${{ github.repository }}/.github/workflows/"
                                    f"{WORKFLOW.name}@${{{{ github.ref }}}}")
    assert "--trust-issuer" not in fetch  # GitHub Actions' issuer is the default
    from gkbuild.publish.signing import GITHUB_ISSUER, trust_list

    assert trust_list([fetch[fetch.index("--trust") + 1]])[0].issuer == GITHUB_ISSUER


def test_every_gkbuild_command_in_the_workflow_parses():
    for args in _commands(_workflow()) + _commands(_workflow(), "verify-on-trainium"):
        cmd = cli.commands[args[0]]
        cmd.make_context(args[0], list(args[1:]))  # raises click.UsageError on an unknown option


def test_the_default_recipe_builds_and_verifies_against_the_stored_golden(tmp_path):
    env = _workflow()["jobs"]["build"]["env"]
    default = lambda expr: re.search(r"'([^']+)'\s*\}\}$", expr).group(1)  # noqa: E731
    recipe_path, golden_path = ROOT / default(env["RECIPE"]), ROOT / default(env["GOLDEN"])
    assert recipe_path.is_file() and golden_path.is_file()
    out = tmp_path / "b"
    compile_build(recipe.load(recipe_path), out=out, quiet=True, compile=False)
    rep = verify_run(out, Golden.load(golden_path))
    assert rep.ok and rep.max_abs_err < 0.05
