"""Planning a farm (no compiler runs here): the keys it plans are the keys a build computes,
variants cross and programs dedupe by key, the cache decides what is missing, --list/--only/
--executor behave as the CI matrix needs, and a job refuses a key its own gkbuild would not make."""

import json
from dataclasses import replace

import pytest

from gkbuild import recipe
from gkbuild.compile import inductor
from gkbuild.compile.cache import CompileCache
from gkbuild.errors import GkError
from gkbuild.farm import job as farm_job
from gkbuild.farm.plan import plan, select, variants
from gkbuild.pipeline.pipeline import compile_build
from tests.conftest import RECIPES, run_cli

TINY = RECIPES / "tiny-cpu.yaml"
ONE_LAYER = "source=synth://tiny?layers=1&seed=0"


def test_the_planned_keys_are_the_keys_a_build_computes(monkeypatch, tmp_path):
    def fake_build(program, sig, batch_sizes, target, path, key):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not compiled here")

    monkeypatch.setattr(inductor, "build", fake_build)
    for sets in ([ONE_LAYER], [ONE_LAYER, "decode.batch_sizes=[2]", "tail.k=64"]):
        built = compile_build(recipe.load(TINY, sets), out=tmp_path / str(len(sets)), quiet=True)
        planned = {j.program: j.key for j in plan([TINY], sets)}
        assert planned == built.manifest["compile"]["cache_keys"]


def test_variants_cross_and_programs_shared_by_recipes_are_one_job():
    assert variants([]) == [[]]
    assert variants(["decode.batch_sizes=[[1, 2], [4]]", "tail.k=[64, 128]"]) == [
        ["decode.batch_sizes=[1, 2]", "tail.k=64"], ["decode.batch_sizes=[1, 2]", "tail.k=128"],
        ["decode.batch_sizes=[4]", "tail.k=64"], ["decode.batch_sizes=[4]", "tail.k=128"]]
    jobs = plan([TINY], [ONE_LAYER], ["decode.batch_sizes=[[1, 2], [4]]", "tail.k=[64, 128]"])
    decodes, tails = [j for j in jobs if j.program == "decode"], [j for j in jobs if j.program == "tail"]
    assert len(decodes) == 2 and len(tails) == 4  # tail.k changes only the tail
    assert all(len(j.recipes) == 2 for j in decodes) and all(len(j.recipes) == 1 for j in tails)
    assert {j.batch for j in decodes} == {"1..2", "4"}
    assert len({j.key for j in jobs}) == 6
    # new weights (another seed) are graph inputs: the same programs
    assert [j.key for j in plan([TINY], ["source=synth://tiny?layers=1&seed=7"])] == \
        [j.key for j in plan([TINY], [ONE_LAYER])]


@pytest.mark.parametrize("bad", ["decode.batch_sizes", "decode.batch_sizes=4", "decode.batch_sizes=[]", "=[1]"])
def test_a_bad_vary_is_one_line(bad):
    with pytest.raises(GkError, match="--vary .*expected KEY=\\[V1, V2, ...\\]"):
        variants([bad])


def test_only_takes_a_key_prefix_and_refuses_what_is_not_one_job():
    jobs = plan([TINY], [ONE_LAYER])
    assert select(jobs, jobs[1].key[:12]) is jobs[1]
    for bad, why in (("abc", "12 to 64 hex"), ("z" * 12, "12 to 64 hex"), ("0" * 64, "no program")):
        with pytest.raises(GkError, match=why):
            select(jobs, bad)


def _push_fake(cache_uri: str, j, tmp_path) -> None:
    """An entry for job ``j`` as a push would store it (the bytes are not a real package: holds()
    verifies entries and blobs without fetching them)."""
    import hashlib

    art = tmp_path / f"{j.program}.pt2"
    art.write_bytes(b"a package " + j.key.encode())
    c = CompileCache(cache_uri, push=True, staging=tmp_path / "staging")
    assert c.push(j.key, j.program, art, {**j.expect, "size": art.stat().st_size,
                                            "sha256": hashlib.sha256(art.read_bytes()).hexdigest()})


def test_list_prints_what_the_cache_misses_and_only_runs_one_cell(tmp_path):
    store = str(tmp_path / "cache")
    jobs = plan([TINY], [ONE_LAYER])
    _push_fake(store, jobs[0], tmp_path)
    r = run_cli("farm", str(TINY), "--set", ONE_LAYER, "--cache", store, "--list", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [(j["key"], j["status"]) for j in rep["jobs"]] == [(jobs[1].key, "missing")] and rep["planned"] == 2
    r = run_cli("farm", str(TINY), "--set", ONE_LAYER, "--cache", store, "--only", jobs[0].key[:16], "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [(j["program"], j["status"], j["where"]) for j in rep["jobs"]] == [("decode", "cached", "cache")]


def test_a_cache_entry_that_does_not_match_is_not_counted_as_held(tmp_path):
    store = str(tmp_path / "cache")
    j = plan([TINY], [ONE_LAYER])[0]
    _push_fake(store, replace(j, expect={**j.expect, "flags": ["--other"]}), tmp_path)
    assert not CompileCache(store).holds(j.key, j.program, j.expect)


def test_a_failed_job_is_reported_and_the_farm_exits_1(tmp_path):
    """A trn2 program on a host without the Neuron SDK: the job fails with the reason, in one row."""
    topo = RECIPES / "tiny-topology-trn3.yaml"
    r = run_cli("farm", str(topo), "--set", "decode.batch_sizes=[128]", "--cache", str(tmp_path / "c"), "--json")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == "gkbuild: error: farm: 2 of 2 jobs failed"
    rows = json.loads(r.stdout)["jobs"]
    assert [j["status"] for j in rows] == ["failed", "failed"]
    assert all("Neuron SDK not installed" in j["error"] for j in rows)


def test_a_job_refuses_a_key_its_own_gkbuild_would_not_make(tmp_path):
    j = plan([TINY], [ONE_LAYER])[1]
    with pytest.raises(GkError, match="this host's gkbuild and compiler make compile key .* the planner's made 0000"):
        farm_job.run(replace(j, key="0" * 64), str(tmp_path / "c"))


def test_a_job_planned_for_another_kind_of_machine_says_so(tmp_path, monkeypatch):
    """Planned on an aarch64 host (its own CPU features in the flags), run on this one."""
    from gkbuild.compile import inductor

    with monkeypatch.context() as m:
        m.setattr(inductor.platform, "machine", lambda: "aarch64")
        m.setattr(inductor, "cpu_features", lambda: {"fp", "asimd", "sve"})
        j = plan([TINY], [ONE_LAYER])[1]
    with pytest.raises(GkError, match=r"planner's made .*, on the same kind of machine \(flags .*--machine=aarch64"):
        farm_job.run(j, str(tmp_path / "c"))


@pytest.mark.parametrize("bad", ["ray:127.0.0.1", "slurm", "ray://"])
def test_a_bad_executor_is_one_line(bad, tmp_path):
    r = run_cli("farm", str(TINY), "--cache", str(tmp_path / "c"), "--executor", bad)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"gkbuild: error: --executor {bad!r}: expected local, ray, or ray://HOST:PORT")


def test_a_vary_cross_product_past_the_limit_is_refused_before_planning(monkeypatch):
    from gkbuild import plan as gk_plan

    planned = []
    monkeypatch.setattr(gk_plan, "make_plan", lambda *a: planned.append(a))  # planning must not start
    hundred = "[" + ", ".join(str(k) for k in range(1, 101)) + "]"
    vary = [f"tail.k={hundred}", f"decode.max_context={hundred}", f"kv_cache.k_scale={hundred}"]  # 10^6 plans
    with pytest.raises(GkError, match=r"--vary: 1 x 100 x 100 x 100 .* is 1000000 plans, over the limit of "
                                      r"1024; split the farm"):
        plan([TINY], [ONE_LAYER], vary)
    with pytest.raises(GkError, match=r"2 x 100 x 6 .* is 1200 plans"):  # recipes count too
        plan([TINY, TINY], [ONE_LAYER], [f"tail.k={hundred}", "tail.emit_logits=[true, false, true, false, true, no]"])
    assert planned == []
    r = run_cli("farm", str(TINY), "--cache", "/nonexistent-store", "--vary", vary[0], "--vary", vary[1],
                "--vary", vary[2], "--list")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "over the limit" in r.stderr
