"""``gkbuild compile RECIPE --to hf://ORG/NAME@BRANCH`` against the fake hub (tests/publish/fake_hub.py,
its state in a folder so the build's worker processes upload into the same hub): the branch ends
as ``compile`` + ``publish --to hf://`` leave it, byte for byte, in one commit; every shard's blob
went up as LFS content from the worker that made it, by way of the build's own branch (gone at the
end); a killed build leaves the branch as it was, and its rerun takes what the killed one committed
to its own branch without emitting it again and sends only the content the hub lacks; no token,
no repo, no branch are one line before any work."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from gkbuild import recipe
from gkbuild.errors import GkError
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.pipeline.state import State
from gkbuild.pipeline.stream import scratch_folder, stream_build
from gkbuild.publish import index
from gkbuild.publish.fetch import fetch
from gkbuild.publish.publish import publish
from tests.conftest import RECIPES, ROOT, run_cli
from tests.publish.fake_hub import FakeHub, upload_mode


TOPO = RECIPES / "tiny-topology-trn3.yaml"


def hub_with(root, repo: str, branch: str = "trn2") -> FakeHub:
    hub = FakeHub(root)
    hub.create_repo(repo, private=True)
    hub.create_branch(repo, branch=branch)
    return hub


def published(build, repo: str, branch: str = "trn2") -> FakeHub:
    """``publish --to hf://`` of a build folder into a fresh fake hub (the reference)."""
    ref = FakeHub()
    publish(build, f"hf://{repo}@{branch}", api=ref, fs=ref, quiet=True)
    return ref


def lfs_blobs(tree: dict[str, bytes]) -> set[str]:
    return {p for p, b in tree.items() if p.startswith("blobs/") and upload_mode(len(b), b[:512]) == "lfs"}


def test_streamed_into_the_hub_it_is_compile_and_publish_in_one_commit(built, tmp_path):
    repo = "my-org/gk-stream-a"
    hub = hub_with(tmp_path / "hub", repo)
    main = hub.head(repo, "main").oid
    res = stream_build(recipe.load(RECIPES / "tiny-cpu.yaml"), f"hf://{repo}@trn2", 64 << 20, quiet=True,
                       compile=False, api=hub, fs=hub)
    ref_build = tmp_path / "ref-build"
    shutil.copytree(built, ref_build)
    want = published(ref_build, repo).head(repo, "trn2")
    got = hub.head(repo, "trn2")
    assert got.tree == want.tree and got.message == want.message  # every file, byte for byte
    assert got.parent == main and hub.head(repo, "main").oid == main  # one commit, on the branch only
    assert sorted(hub.repos[repo]) == ["main", "trn2"]  # the build's own branch is gone
    idx = index.parse(got.tree[index.NAME], "publish.json")
    assert res.manifest["build_id"] == idx["build_id"]
    shards = {e["blob"] for e in idx["files"] if e["path"].startswith("weights/")}
    by = {path: pid for _, path, _, pid in hub.sent()}
    assert shards and shards <= lfs_blobs(got.tree)
    assert all(by[b] != os.getpid() for b in shards)  # each shard's content sent by the worker that made it
    assert res.stream["blobs_sent"] >= len(shards) and 0 < res.stream["peak_disk"] <= 64 << 20
    assert fetch(f"hf://{repo}@trn2", tmp_path / "got", api=hub, fs=hub, quiet=True)["build_id"] == idx["build_id"]
    assert problems(tmp_path / "got") == []


def test_no_token_no_repo_no_branch_are_one_line_before_any_work(tmp_path):
    r = recipe.load(RECIPES / "tiny-cpu.yaml")
    hub = hub_with(tmp_path / "hub", "my-org/gk-stream-b")
    cases = [("hf://my-org/gk-stream-b@trn2", None, r"no Hugging Face token \(set HF_TOKEN or run `hf auth login`\)"),
             ("hf://my-org/nope@trn2", "hf_x", r"repository not found .*create it first \(hf repos create my-org/nope "
                                               r"--private\)"),
             ("hf://my-org/gk-stream-b@nope", "hf_x", r"branch 'nope' does not exist.*\(hf repos branch create "
                                                      r"my-org/gk-stream-b nope\)")]
    for uri, token, says in cases:
        hub.token = token
        with pytest.raises(GkError, match=says):
            stream_build(r, uri, 64 << 20, quiet=True, compile=False, api=hub, fs=hub)
        assert not scratch_folder(r, uri).exists()  # nothing read, planned or staged
    assert hub.sent() == [] and len(hub.repos["my-org/gk-stream-b"]["trn2"]) == 1


def test_the_limit_must_hold_a_shard_and_its_blob_and_is_checked_before_anything_is_sent(tmp_path):
    hub = hub_with(tmp_path / "hub", "my-org/gk-stream-d")
    with pytest.raises(GkError, match=r"--scratch-limit 4.00 MiB: .*weights/embed-host.safetensors \(2.00 MiB, and its "
                                      r"blob, plus"):
        stream_build(recipe.load(TOPO), "hf://my-org/gk-stream-d@trn2", 4 << 20, quiet=True, compile=False, api=hub,
                     fs=hub)
    assert hub.sent() == [] and sorted(hub.repos["my-org/gk-stream-d"]) == ["main", "trn2"]  # no own branch yet


def test_the_cli_without_a_token_says_so_in_one_line(tmp_path):
    """huggingface_hub itself (no fake): with no HF_TOKEN and no saved token, before any request."""
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": "", "HF_HUB_OFFLINE": "1",
           "GKBUILD_CACHE": str(tmp_path / "cache")}
    r = run_cli("compile", str(RECIPES / "tiny-cpu.yaml"), "--to", "hf://my-org/gk@trn2", env=env)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf://my-org/gk@trn2: no Hugging Face token" in lines[0], r.stderr
    assert not (tmp_path / "cache" / "stream").exists()


KILLED = """
import sys
from pathlib import Path
from gkbuild import recipe
from gkbuild.pipeline.stream import stream_build
from tests.publish.fake_hub import FakeHub
hub = FakeHub(Path(sys.argv[1]))
stream_build(recipe.load(sys.argv[2]), sys.argv[3], 24 << 20, jobs=1, quiet=True, compile=False, api=hub, fs=hub)
"""


@pytest.mark.slow
def test_a_killed_hub_stream_leaves_the_branch_and_its_rerun_sends_nothing_twice(tmp_path, monkeypatch):
    """tiny-topology (~50 shards), one worker, killed (SIGKILL, with its workers) once a third of
    the blobs are up: the branch still points at the build published before; the rerun commits
    compile + publish's tree byte for byte, takes the blobs the killed run committed to its own
    branch from there, and sends exactly the LFS content the hub lacks (a shard whose content was
    sent but not yet committed there is emitted again: the hub, as huggingface_hub's batch call
    tells it, does not take its content twice)."""
    repo, uri = "my-org/gk-stream-c", "hf://my-org/gk-stream-c@trn2"
    monkeypatch.setenv("GKBUILD_CACHE", str(tmp_path / "cache"))  # the killed run's state, for the rerun
    hub = hub_with(tmp_path / "hub", repo)
    ref_build = tmp_path / "ref-build"
    compile_build(recipe.load(TOPO), out=ref_build, quiet=True, compile=False)
    want = published(ref_build, repo).head(repo, "trn2")
    shards = {e["blob"] for e in index.parse(want.tree[index.NAME], "x")["files"] if e["path"].startswith("weights/")}
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=tmp_path / "other", quiet=True, compile=False)
    publish(tmp_path / "other", uri, api=hub, fs=hub, quiet=True)  # the branch holds another build
    before = hub.head(repo, "trn2")
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path / "hub"), str(TOPO), uri], cwd=ROOT,
                         env=dict(os.environ, GKBUILD_SYNC_INTERVAL="0"), start_new_session=True,
                         stderr=subprocess.PIPE)  # its state saved after each job
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline and len(hub.sent()) < len(shards) // 3:
        time.sleep(0.1)
    assert p.poll() is None, p.stderr.read()
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    p.stderr.close()
    assert hub.head(repo, "trn2").oid == before.oid  # nothing visible
    side = next(b for b in hub.repos[repo] if b.startswith("gkbuild-stream-"))
    on_side = set(hub.head(repo, side).files)
    recorded = [p for p, r in State(scratch_folder(recipe.load(TOPO), uri)).shards.items()
                if r["entry"]["blob"] in on_side]
    assert recorded  # the jobs that ended before the kill: on the build's branch, in its state
    first = len(hub.sent())
    res = stream_build(recipe.load(TOPO), uri, 24 << 20, quiet=True, compile=False, api=hub, fs=hub)
    got = hub.head(repo, "trn2")
    assert got.tree == want.tree and got.parent == before.oid
    assert res.manifest["build_id"] == index.parse(got.tree[index.NAME], "x")["build_id"]
    had = {path for _, path, _, _ in hub.sent()[:first]}
    again = [path for _, path, _, _ in hub.sent()[first:]]
    assert shards & had and shards - had  # killed mid-stream
    assert sorted(again) == sorted(lfs_blobs(got.tree) - had)  # the rerun sent exactly what the hub lacked
    files = [f for f in res.manifest["files"] if f["path"].startswith("weights/")]
    assert 0 < res.shards_written <= len(files) - len(recorded)  # those on the build's branch not emitted again
    assert side not in hub.repos[repo]
    assert 0 < res.stream["peak_disk"] <= 24 << 20
