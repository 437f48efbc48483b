"""The GitHub Actions workflow: it parses, streams the build into the store (compile --to, signed,
on a bounded scratch disk), then fetches it back -> verify (stored golden) -> check in that order, fans the compile farm out over the programs `farm --list --json` names
(one matrix cell a compile key, `farm --only KEY`) before the build assembles from the cache,
every gkbuild command in it is valid for this CLI, and the defaults it names exist and pass (the
stored golden still verifies the default recipe's build)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from gkbuild import recipe
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.cli import cli
from gkbuild.verify import run as verify_run
from gkbuild.golden import Golden
from tests.conftest import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "build-artifacts.yml"
ZIZMOR_CONFIG = ROOT / ".github" / "zizmor.yml"


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _commands(wf: dict, job: str = "build") -> list[list[str]]:
    """Every gkbuild invocation in the job's run steps, env references filled with sample values."""
    job = wf["jobs"][job]
    env = {"RECIPE": "recipes/tiny-cpu.yaml", "GOLDEN": "goldens/tiny.safetensors", "OUT": "artifacts/x",
           "STORE": "s3://bucket/builds", "SCRATCH": "8GiB", "NEFF": "--require-neff", "KEY": "0123456789abcdef",
           "SIGNER": "https://github.com/org/gk/.github/workflows/build-artifacts.yml@refs/tags/build-1",
           "SOURCE": "hf://openai/gpt-oss-120b@main", "KV": "fp8_e4m3", "K_SCALE": "1.0", "V_SCALE": "1.0"}
    cmds = []
    for step in job["steps"]:
        for line in step.get("run", "").splitlines():
            line = line.split(">")[0].split(";;")[0].strip()
            if ".venv/bin/gkbuild" in line:
                line = re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], line[line.index(".venv/bin/gkbuild"):])
                cmds.append(shlex.split(line)[1:])
    return cmds


def test_the_workflow_streams_the_build_into_the_store_then_fetches_verifies_and_checks_it():
    wf = _workflow()
    on = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as true
    assert on["push"]["tags"] == ["build-*"]
    cmds = _commands(wf)
    assert [c[0] for c in cmds] == ["compile", "fetch", "verify", "check"]
    build = cmds[0]
    assert build[build.index("--to") + 1] == "s3://bucket/builds" and "--out" not in build  # streamed: no build folder
    assert build[build.index("--scratch-limit") + 1] == "8GiB" and build[build.index("--sign") + 1] == "sigstore"
    assert "--golden" in cmds[2] and cmds[1][cmds[1].index("--to") + 1] == cmds[2][1] == cmds[3][1]
    job = wf["jobs"]["build"]
    steps = job["steps"]
    assert job["env"]["STORE"].startswith("${{ vars.GKBUILD_STORE ||") and "GKBUILD_SCRATCH_LIMIT" in job["env"]["SCRATCH"]
    # a recipe without a stored golden (120b) is never fetched back onto the runner's disk
    later = [s for s in steps if any(f"gkbuild {c}" in s.get("run", "") for c in ("fetch", "verify", "check"))]
    assert len(later) == 3 and all(s["if"] == "env.GOLDEN != 'none' && env.GOLDEN != 'source'" for s in later)
    assert "secrets.HF_TOKEN" in job["env"]["HF_TOKEN"]
    assert any(s.get("run", "").strip() == "make install" for s in steps)
    assert cli.commands["compile"].make_context("compile", build[1:])  # every option exists


def test_a_build_too_large_to_fetch_is_verified_in_the_store_against_a_golden_of_its_source():
    """GKBUILD_GOLDEN=source: a job after the build computes the golden from the build's own source
    (read by range, in the build's KV format, one pass of 4 x 32), kept as an artifact named by the
    source's content, and verifies the store in place under the scratch limit, trusting only this workflow's signature;
    it signs nothing and keeps the golden and the report."""
    wf = _workflow()
    job = wf["jobs"]["verify-in-place"]
    assert job["needs"] == "build" and "== 'source'" in job["if"] and "vars.GKBUILD_STORE != ''" in job["if"]
    assert job["permissions"] == {"contents": "read"}
    outputs = wf["jobs"]["build"]["outputs"]
    for var, out in (("SOURCE", "source"), ("KV", "kv"), ("K_SCALE", "k-scale"), ("V_SCALE", "v-scale")):
        assert job["env"][var] == f"${{{{ needs.build.outputs.{out} }}}}" and "steps.compile.outputs." in outputs[out]
    compile_step = next(s for s in wf["jobs"]["build"]["steps"] if s.get("id") == "compile")
    for key in ("source", "sha256", "kv", "k_scale", "v_scale"):
        assert f"{key}=" in compile_step["run"] and outputs[{"sha256": "source-sha256"}.get(key, key.replace("_", "-"))]
    golden, verify = _commands(wf, "verify-in-place")
    assert golden[:2] == ["golden", "hf://openai/gpt-oss-120b@main"]
    assert golden[golden.index("--prompts") + 1] == "4" and golden[golden.index("--prompt-len") + 1] == "32"
    assert golden[golden.index("--steps") + 1] == "0" and golden[golden.index("--kv") + 1] == "fp8_e4m3"
    out = golden[golden.index("--out") + 1]
    assert verify[:2] == ["verify", "s3://bucket/builds"] and verify[verify.index("--golden") + 1] == out
    assert verify[verify.index("--scratch-limit") + 1] == "8GiB" and "--trust" in verify
    steps = job["steps"]
    assert not any(s.get("uses", "").startswith("actions/cache@") for s in steps)  # no poisonable reference
    kept = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact") and s["with"]["path"] == out)
    assert "needs.build.outputs.source-sha256" in kept["with"]["name"] and "needs.build.outputs.kv" in kept["with"]["name"]
    # the same arguments a golden and verify of this CLI take, and a compile report that has them
    assert cli.commands["golden"].make_context("golden", golden[1:])
    assert cli.commands["verify"].make_context("verify", verify[1:])


def test_the_compile_report_names_the_source_a_golden_of_the_build_is_computed_from(tmp_path):
    from gkbuild.pipeline.manifest import checkpoint_hash
    from gkbuild.reference import build_kv

    r = compile_build(recipe.load(ROOT / "recipes" / "tiny-cpu.yaml"), out=tmp_path / "b", quiet=True, compile=False)
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert r.summary()["source"] == {"uri": m["source"]["uri"], "sha256": checkpoint_hash(m["source"]["files"]),
                                     "kv": build_kv(m).to_meta()}


def test_the_build_job_keeps_the_verify_report_as_an_artifact():
    """verify writes its HTML report into a folder the upload step keeps, even when a step failed."""
    wf = _workflow()
    verify = next(c for c in _commands(wf) if c[0] == "verify")
    report = verify[verify.index("--report") + 1]
    upload = next(s for s in wf["jobs"]["build"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact")
                  and s["with"]["name"] == "gkbuild-reports")
    assert upload["if"] == "always()"
    kept = [p.strip().rstrip("/") for p in upload["with"]["path"].splitlines() if p.strip()]
    assert report in kept and "verify-report.json" in kept


def test_the_trainium_job_fetches_the_published_build_and_verifies_its_neffs():
    wf = _workflow()
    job = wf["jobs"]["verify-on-trainium"]
    assert job["needs"] == "build" and "GKBUILD_TRAINIUM_RUNNER" in job["runs-on"]
    cmds = _commands(wf, "verify-on-trainium")
    assert [c[0] for c in cmds] == ["fetch", "verify"] and cmds[1][cmds[1].index("--engine") + 1] == "neuron"
    assert cmds[0][1] == "s3://bucket/builds" and "GKBUILD_STORE" in job["if"]  # from the store the build streamed into
    # the build job needs no NeuronCore: it installs the SDK for trn recipes and traces on the host
    assert any("gkbuild[neuron]" in s.get("run", "") or ".[neuron]" in s.get("run", "")
               for s in wf["jobs"]["build"]["steps"])


def test_the_farm_fans_out_over_the_missing_programs_then_the_build_assembles(tmp_path):
    wf = _workflow()
    jobs = wf["jobs"]
    plan, farm, build = jobs["plan"], jobs["farm"], jobs["build"]
    assert [c[0] for c in _commands(wf, "plan")] == ["farm"] and "--list" in _commands(wf, "plan")[0]
    assert "--json" in _commands(wf, "plan")[0]
    listing = next(s for s in plan["steps"] if s.get("id") == "list")
    assert plan["outputs"]["keys"] == "${{ steps.list.outputs.keys }}"
    assert "jq -c '[.jobs[].key]'" in listing["run"] and 'echo "keys=[]"' in listing["run"]
    # one matrix cell a key the plan listed, each running exactly that job
    assert farm["needs"] == "plan" and farm["if"] == "needs.plan.outputs.keys != '[]'"
    assert farm["strategy"]["matrix"]["key"] == "${{ fromJSON(needs.plan.outputs.keys) }}"
    assert farm["env"]["KEY"] == "${{ matrix.key }}"
    (cell,) = _commands(wf, "farm")
    assert cell[0] == "farm" and cell[cell.index("--only") + 1] == "0123456789abcdef"
    # the build runs after the farm (or when it was skipped: nothing missing, or no cache) and reads the cache
    assert build["needs"] == ["plan", "farm"] and "needs.farm.result == 'skipped'" in build["if"]
    for job in (plan, farm, build):
        assert job["env"]["GKBUILD_COMPILE_CACHE"] == "${{ vars.GKBUILD_COMPILE_CACHE }}"
    # what the plan step feeds the matrix, from the real command: 64-hex keys each --only accepts
    store = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "gkbuild", *_commands(wf, "plan")[0]], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, GKBUILD_COMPILE_CACHE=str(store)))
    assert r.returncode == 0, r.stderr
    keys = [j["key"] for j in json.loads(r.stdout)["jobs"]]
    assert len(keys) == 2 and all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys)
    for k in keys:
        cli.commands["farm"].make_context("farm", [*cell[1:cell.index("--only") + 1], k, "--cache", str(store)])


def test_the_build_is_signed_keyless_by_the_runner_and_the_fetching_job_trusts_that_identity():
    wf = _workflow()
    assert wf["jobs"]["build"]["permissions"]["id-token"] == "write"  # the runner may ask GitHub for its OIDC token
    build = _commands(wf)[0]
    assert build[0] == "compile" and build[build.index("--sign") + 1] == "sigstore"
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


def test_every_gkbuild_command_in_the_workflow_parses(monkeypatch):
    monkeypatch.setenv("GKBUILD_COMPILE_CACHE", "s3://bucket/cache")  # as the jobs' env gives it
    for args in [c for job in _workflow()["jobs"] for c in _commands(_workflow(), job)]:
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


# -- the workflow as a supply-chain linter sees it -------------------------------------------------------
def _zizmor(workflow: Path, config: Path = ZIZMOR_CONFIG) -> list[dict]:
    """zizmor's findings on ``workflow`` (offline: no GitHub API), honoring the ignores in ``config``."""
    exe = Path(sys.executable).with_name("zizmor")
    assert exe.is_file(), f"{exe}: zizmor is not installed (it is in gkbuild's test extras)"
    r = subprocess.run([str(exe), "--offline", "--strict-collection", "--no-progress", "--format", "json", "--config", str(config),
                        str(workflow)], capture_output=True, text=True, timeout=120)
    # 0: no findings; 10-14: findings (by the highest severity); anything else: zizmor itself failed
    assert r.returncode == 0 or 10 <= r.returncode <= 14, r.stderr
    return json.loads(r.stdout)


def _where(f: dict) -> str:
    loc = f["locations"][0]
    return f"{loc['symbolic']['key']['Local']['given_path']}:{loc['concrete']['location']['start_point']['row'] + 1}"


def test_zizmor_finds_nothing_unjustified_in_the_workflow():
    """Every finding is fixed or accepted, with its reason, in .github/zizmor.yml."""
    found = _zizmor(WORKFLOW)
    assert found == [], "; ".join(f"{f['ident']} at {_where(f)}: {f['desc']}" for f in found)


def test_zizmor_reports_what_the_workflow_used_to_do(tmp_path):
    """The check bites: tag-pinned actions, a checkout that keeps the token, a workflow-wide id-token."""
    text = WORKFLOW.read_text()
    text = re.sub(r"(uses: actions/checkout)@[0-9a-f]{40}( # \S+)?", r"\1@v4", text, count=1)
    text = text.replace("        with:\n          persist-credentials: false\n", "", 1)  # the first checkout's
    text = re.sub(r"\n    permissions:\n(      .*\n)+", "\n", text)  # the jobs' own, and one for the workflow
    text = text.replace("permissions: {}\n", "permissions:\n  contents: read\n  id-token: write\n", 1)
    bad = tmp_path / WORKFLOW.name
    bad.write_text(text)
    assert {f["ident"] for f in _zizmor(bad)} == {"unpinned-uses", "artipacked", "excessive-permissions"}


def test_every_accepted_zizmor_finding_says_why():
    """An ignore in the config names its place and carries its reason on the same line."""
    cfg = yaml.safe_load(ZIZMOR_CONFIG.read_text())
    assert cfg["rules"]["unpinned-uses"]["config"]["policies"] == {"*": "hash-pin"}  # GitHub's own actions too
    places = [i for rule in cfg["rules"].values() for i in rule.get("ignore", [])]
    lines = ZIZMOR_CONFIG.read_text().splitlines()
    for place in places:
        assert re.fullmatch(r"[\w.-]+\.ya?ml:\d+(:\d+)?", place), place
        assert any(place in ln and "#" in ln.split(place, 1)[1] for ln in lines), f"{place}: ignored without a reason"


def test_every_action_is_pinned_to_a_commit_with_its_tag_beside_it():
    """Any job's ``uses:``, not only today's jobs: a full sha, and the tag it was, for whoever bumps it."""
    uses = [ln.strip() for ln in WORKFLOW.read_text().splitlines() if re.match(r"\s*(- )?uses:", ln)]
    assert uses
    for u in uses:
        assert re.fullmatch(r"(- )?uses: [\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+(\.\d+)*", u), u


@pytest.mark.parametrize("job", sorted(_workflow()["jobs"]))
def test_each_job_holds_only_what_it_uses(job):
    """Nothing workflow-wide; each job reads the repository; id-token only where the build is signed; no
    checkout keeps the token in .git/config."""
    wf = _workflow()
    assert wf["permissions"] == {}
    spec = wf["jobs"][job]
    signs = any("--sign" in s.get("run", "") for s in spec["steps"])
    assert spec["permissions"] == {"contents": "read", **({"id-token": "write"} if signs else {})}
    for s in spec["steps"]:
        if s.get("uses", "").startswith("actions/checkout@"):
            assert s["with"]["persist-credentials"] is False
