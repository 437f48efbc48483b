"""The compile farm for real: a Ray head and a worker node on 127.0.0.1 (`ray start`), an S3 cache
on a moto server, real AOTInductor compiles.

One farm run over two recipes x two batch sizes fills the cache; during it a test kills the
worker running a decode job and Ray's retry completes it. Then each recipe's build assembles from
the cache on two "hosts" with no compile and the same build id; the local executor compiles two
different programs at once (intervals overlap) into the same bytes the Ray workers made; Ctrl-C
cancels outstanding tasks. Recipes use the 1-layer tiny model to keep compiles short."""

import json
import os
import signal
import subprocess
import sys
import time

import boto3
import pytest
import s3fs

from gkbuild import recipe
from gkbuild.compile import inductor
from gkbuild.farm.plan import plan
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from tests.conftest import RECIPES, run_cli
from tests.raycluster import ray_cluster, running_tasks

pytestmark = pytest.mark.slow
pytest.importorskip("ray")  # the test extra installs it; a bare install has no `gkbuild farm --executor ray`

TINY = RECIPES / "tiny-cpu.yaml"
ONE_LAYER = "source=synth://tiny?layers=1&seed=0"
VARY = "decode.batch_sizes=[[1, 2], [1, 4]]"


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """tiny-cpu, and a second recipe on other weights (seed 1) with another tail (k 128): its
    decode programs are tiny-cpu's, its tails its own."""
    d = tmp_path_factory.mktemp("recipes")
    a, b = d / "tiny-a.yaml", d / "tiny-b.yaml"
    text = TINY.read_text().replace("synth://tiny?layers=2&seed=0", "synth://tiny?layers=1&seed=0")
    a.write_text(text)
    b.write_text(text.replace("seed=0", "seed=1").replace("k: 256", "k: 128"))
    return [a, b]


@pytest.fixture(scope="module")
def cluster(s3_server):
    """Started after the S3 server: the workers inherit its endpoint (and the session's GKBUILD_CACHE)."""
    with ray_cluster(nodes=2, cpus=1, memory_gib=4) as c:
        yield c


def _farm(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gkbuild", "farm", *map(str, args), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture(scope="module")
def farmed(cluster, recipes, s3_server):
    """One farm over both recipes x both batch sizes into an empty S3 cache, connected to the
    cluster by its address (RAY_ADDRESS: the Ray Client's ray:// server failed to initialise its
    per-driver process under this machine's load once, so the tests use the direct address); the
    worker running the first decode job is killed with SIGKILL 3 s into it."""
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="gk-farm")
    uri = "s3://gk-farm/cache"
    p = _farm(*recipes, "--vary", VARY, "--cache", uri, "--executor", "ray", "--retries", "2",
              env=dict(os.environ, RAY_ADDRESS=cluster["gcs"]))
    killed, deadline = None, time.monotonic() + 600
    while killed is None and p.poll() is None and time.monotonic() < deadline:
        for w in running_tasks("gkbuild-farm decode"):
            title = " ".join(w.cmdline())
            time.sleep(3)
            if w.is_running() and " ".join(w.cmdline()) == title:  # still on that job
                killed = (w.pid, title.split()[-1])  # (pid, key prefix)
                w.kill()
                break
        time.sleep(0.2)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err
    return uri, json.loads(out), killed


def test_the_farm_fills_the_s3_cache_through_ray(farmed, recipes):
    uri, rep, _ = farmed
    planned = plan(recipes, [], [VARY])
    assert {j["key"] for j in rep["jobs"]} == {j.key for j in planned} and len(planned) == 6  # 2 decodes, 4 tails
    assert rep["compiled"] == 6 and rep["failed"] == 0
    assert all(" node " in j["where"] for j in rep["jobs"])  # host, Ray node and worker process
    fs = s3fs.S3FileSystem(use_listings_cache=False)
    entries = {p.rsplit("/", 1)[1].removesuffix(".json") for p in fs.find("gk-farm/cache/compile")}
    assert entries == {j.key for j in planned}
    again = run_cli("farm", *map(str, recipes), "--vary", VARY, "--cache", uri, "--json")  # a warm cache
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["cached"] == 6


def test_a_killed_worker_is_retried_by_ray(farmed):
    _, rep, killed = farmed
    assert killed is not None, "no decode job was seen running"
    pid, prefix = killed
    job = next(j for j in rep["jobs"] if j["key"].startswith(prefix))
    assert job["status"] == "compiled" and f"pid {pid}" not in job["where"]  # completed in another process


def test_each_recipe_assembles_from_the_cache_with_no_compile_and_one_build_id(farmed, recipes, monkeypatch,
                                                                              tmp_path):
    uri, rep, _ = farmed

    def no_compile(*a, **kw):
        raise AssertionError("compiled, though the farm filled the cache")

    monkeypatch.setattr(inductor, "build", no_compile)
    shas = {j["key"]: j["sha256"] for j in rep["jobs"]}
    for r in recipes:
        for sizes in ("[1, 2]", "[1, 4]"):
            ids = set()
            for host in ("host1", "host2"):
                out = tmp_path / host / f"{r.stem}-{len(ids)}{sizes[-2]}"
                res = compile_build(recipe.load(r, [f"decode.batch_sizes={sizes}"]), out=out, quiet=True, cache=uri)
                stage = next(s for s in res.stages if s.name == "compile")
                assert "2 from the compile cache" in stage.detail
                keys = res.manifest["compile"]["cache_keys"]
                assert {a["sha256"] for a in res.manifest["compile"]["artifacts"]} == {shas[k] for k in keys.values()}
                assert problems(out) == []
                ids.add(res.manifest["build_id"])
            assert len(ids) == 1


def test_two_programs_compile_at_once_locally_into_the_bytes_ray_made(farmed, recipes, tmp_path):
    """The per-program compile folder: two different programs' compiles overlap in time, and each
    archive is byte-identical to the one a Ray worker compiled in another run."""
    _, rep, _ = farmed
    r = run_cli("farm", str(recipes[0]), "--set", "decode.batch_sizes=[1, 2]", "--cache", str(tmp_path / "c"),
                "--executor", "local", "-j", "2", "--json")
    assert r.returncode == 0, r.stderr
    local = json.loads(r.stdout)["jobs"]
    assert [j["status"] for j in local] == ["compiled", "compiled"]
    (a0, a1), (b0, b1) = [(j["start"], j["end"]) for j in local]
    assert max(a0, b0) < min(a1, b1), f"the compiles did not overlap: {local}"
    ray_sha = {j["key"]: j["sha256"] for j in rep["jobs"]}
    assert {j["key"]: j["sha256"] for j in local} == {j["key"]: ray_sha[j["key"]] for j in local}


def test_ctrl_c_cancels_outstanding_tasks(cluster, recipes, s3_server):
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="gk-farm-cancel")
    uri = "s3://gk-farm-cancel/cache"
    env = dict(os.environ, RAY_ADDRESS=cluster["gcs"])  # the `ray` executor finds the cluster by address
    p = _farm(recipes[0], "--set", "decode.batch_sizes=[1, 8]", "--cache", uri, "--executor", "ray", env=env)
    deadline = time.monotonic() + 300
    while not running_tasks("gkbuild-farm ") and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_tasks("gkbuild-farm "), "no farm task started"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "interrupted" in err
    deadline = time.monotonic() + 60
    while running_tasks("gkbuild-farm ") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running_tasks("gkbuild-farm ") == []  # the running task was killed, the pending one never ran
    assert s3fs.S3FileSystem(use_listings_cache=False).find("gk-farm-cancel/cache/compile") == []
