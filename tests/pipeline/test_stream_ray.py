"""``gkbuild compile --to STORE --executor ray`` on a real local Ray cluster (a head and a worker
node, `ray start`): the shard groups run as Ray tasks that read their own source ranges and send
their own blobs; one task's worker is killed mid-job and Ray's retry completes it. The store then
holds exactly what ``compile`` + ``publish`` of the same recipe hold, byte for byte, with the same
build id, and no node staged more than the limit."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gkbuild.checkpoint.source import cache_root
from gkbuild.pipeline.stream import DiskWatch
from tests.pipeline.test_stream import LIMIT, RECIPE, SOURCE, local, objects, reference, s3  # noqa: F401
from tests.raycluster import ray_cluster, running_tasks

pytestmark = pytest.mark.slow
pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(s3):
    """Started inside the module's S3 server: the workers inherit its endpoint and the session's
    GKBUILD_CACHE (where they stage)."""
    with ray_cluster(nodes=2, cpus=1, memory_gib=4) as c:
        yield c


def test_the_ray_executor_streams_the_same_build_and_survives_a_lost_worker(s3, reference, cluster, tmp_path):
    _, client = s3
    client.create_bucket(Bucket="ray-dst")
    env = local(tmp_path)
    staging = cache_root() / "stream" / "staging"  # the workers' (they run on this machine)
    with DiskWatch(*map(Path, env.values()), staging) as disk:
        p = subprocess.Popen([sys.executable, "-m", "gkbuild", "compile", str(RECIPE), "--set", SOURCE, "--to",
                              "s3://ray-dst/b", "--scratch-limit", "24MiB", "--json", "--executor", "ray",
                              "--jobs", "2"], env=dict(os.environ, **env, RAY_ADDRESS=cluster["gcs"]),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        killed, deadline = None, time.monotonic() + 600
        while killed is None and p.poll() is None and time.monotonic() < deadline:
            for w in running_tasks("gkbuild-stream weights/expert"):
                time.sleep(1)
                if w.is_running():
                    killed = " ".join(w.cmdline())
                    w.kill()
                    break
            time.sleep(0.1)
        out, err = p.communicate(timeout=600)
    assert killed, "no stream task was caught running"
    assert p.returncode == 0, err
    ref_objects, ref_id = reference
    report = json.loads(out)
    assert report["build_id"] == ref_id and report["stream"]["executor"] == "ray"
    assert objects(client, "ray-dst", "b") == ref_objects
    assert 0 < disk.peak <= LIMIT
    # the tasks' own measure of their node's staging (the driver's folder does not hold it: on a real
    # cluster it is another host's disk)
    assert 0 < report["stream"]["peak_disk_workers"] <= LIMIT


RAY_TO_HUB = """
import os, sys
from pathlib import Path
from gkbuild import recipe
from gkbuild.pipeline.stream import stream_build
from tests.publish.fake_hub import FakeHub
hub = FakeHub(Path(sys.argv[1]))
print(os.getpid())
stream_build(recipe.load(sys.argv[2]), sys.argv[3], 64 << 20, executor="ray", jobs=2, quiet=True, compile=False,
             api=hub, fs=hub)
"""


def test_the_ray_executor_streams_into_the_hub(cluster, built, tmp_path):
    """The hub store travels to each task inside its job (``HubStore.streaming``: here the fake
    hub, its state in a folder on this machine; a real one's tasks use their node's token): the
    tasks send the shards' content themselves, the driver commits compile + publish's tree."""
    from gkbuild.publish import index
    from tests.conftest import RECIPES, ROOT
    from tests.pipeline.test_stream_hub import hub_with, lfs_blobs, published

    repo = "my-org/gk-ray"
    hub = hub_with(tmp_path / "hub", repo)
    r = subprocess.run([sys.executable, "-c", RAY_TO_HUB, str(tmp_path / "hub"), str(RECIPES / "tiny-cpu.yaml"),
                        f"hf://{repo}@trn2"], cwd=ROOT, env=dict(os.environ, **local(tmp_path),
                                                                 RAY_ADDRESS=cluster["gcs"]),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    got = hub.head(repo, "trn2")
    assert got.tree == published(built, repo).head(repo, "trn2").tree
    by = {path: pid for _, path, _, pid in hub.sent()}
    shards = {e["blob"] for e in index.parse(got.tree[index.NAME], "x")["files"] if e["path"].startswith("weights/")}
    assert shards and shards <= lfs_blobs(got.tree)
    assert all(by[b] != int(r.stdout.split()[0]) for b in shards)  # sent by the tasks, not the driver
