"""The hub store up to huggingface_hub's API boundary: what a publish commits (one commit per
build, blobs through CommitOperationAdd, stale blobs deleted, a private repo), that republishing
commits nothing, and that a fetch reads every file at the one commit it pinned."""

from types import SimpleNamespace

import pytest

from gkbuild import recipe
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.errors import GkError
from gkbuild.publish import index
from gkbuild.publish.fetch import fetch
from gkbuild.publish.publish import publish
from tests.conftest import RECIPES
from tests.publish.fake_hub import FakeHub

REPO = "my-org/gpt-oss-gk"


def test_publish_is_one_commit_of_blobs_and_index_in_a_private_repo(build):
    hub = FakeHub()
    rep = publish(build, f"hf://{REPO}@trn2", api=hub, fs=hub, quiet=True)
    m = mf.load(build)
    head = hub.head(REPO, "trn2")
    assert rep["where"] == f"hf://{REPO}@trn2 commit {head.oid}"
    assert hub.private[REPO] is True
    assert head.message == f"gkbuild publish tiny-cpu build {m['build_id'][:16]}"
    idx = index.parse(head.tree[index.NAME], "publish.json")
    assert set(head.added) == {index.NAME} | index.blobs(idx) == set(head.tree)
    assert len(head.added) == len(m["files"]) + 2  # every file, the manifest, the index
    assert hub.head(REPO, "main").tree == {}  # the branch took the build, main stayed empty
    assert not (build / ".gkbuild" / "publish").exists()  # staging cleaned after the commit


def test_republishing_commits_nothing_and_a_change_commits_only_it(build):
    hub = FakeHub()
    publish(build, f"hf://{REPO}", api=hub, fs=hub, quiet=True)
    n = len(hub.repos[REPO]["main"])
    assert publish(build, f"hf://{REPO}", api=hub, fs=hub, quiet=True)["already"]
    assert len(hub.repos[REPO]["main"]) == n
    old_tail = next(e["blob"] for e in index.parse(hub.head(REPO).tree[index.NAME], "x")["files"]
                    if e["path"] == "layout/tail.json")
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    publish(build, f"hf://{REPO}", api=hub, fs=hub, quiet=True)
    head = hub.head(REPO)
    assert len(hub.repos[REPO]["main"]) == n + 1
    assert len(head.added) == 3  # layout/tail.json, manifest.json, publish.json
    assert old_tail in head.deleted and len(head.deleted) == 2  # the old tail metadata and old manifest


def test_fetch_from_the_hub_pins_one_commit(build, tmp_path):
    hub = FakeHub()
    publish(build, f"hf://{REPO}", api=hub, fs=hub, quiet=True)
    pinned = hub.head(REPO).oid
    seen = []
    real_open = hub.open

    def open_and_race(path, mode="rb", block_size=None, revision=None, **kw):
        seen.append(revision)
        f = real_open(path, mode, block_size=block_size, revision=revision)
        if len(seen) == 2:  # someone publishes a new build mid-fetch
            compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True,
                          compile=False)
            publish(build, f"hf://{REPO}", api=hub, fs=SimpleNamespace(open=real_open), quiet=True)
        return f

    hub.open = open_and_race
    rep = fetch(f"hf://{REPO}", tmp_path / "got", api=hub, fs=hub, quiet=True, jobs=1)
    assert set(seen) == {pinned} and hub.head(REPO).oid != pinned
    assert problems(tmp_path / "got") == [] and rep["build_id"] != mf.load(build)["build_id"]


def test_missing_repo_or_revision_is_one_clear_line(tmp_path):
    hub = FakeHub()
    with pytest.raises(GkError, match="repository not found"):
        fetch(f"hf://{REPO}", tmp_path / "a", api=hub, fs=hub, quiet=True)
    hub.create_repo(REPO)
    with pytest.raises(GkError, match="revision 'nope' does not exist"):
        fetch(f"hf://{REPO}@nope", tmp_path / "a", api=hub, fs=hub, quiet=True)
    with pytest.raises(GkError, match="no publish.json"):
        fetch(f"hf://{REPO}", tmp_path / "a", api=hub, fs=hub, quiet=True)
    assert not (tmp_path / "a").exists()


def test_a_publish_racing_another_is_refused_not_interleaved(build):
    from huggingface_hub import CommitOperationAdd

    hub = FakeHub()
    publish(build, f"hf://{REPO}", api=hub, fs=hub, quiet=True)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    real = hub.create_commit

    def another_lands_first(*a, **k):
        real(REPO, [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=b"x")],
             commit_message="someone else", revision="main")
        return real(*a, **k)

    hub.create_commit = another_lands_first
    with pytest.raises(GkError, match="the hub refused the request: 412"):
        publish(build, f"hf://{REPO}", api=hub, fs=hub, quiet=True)
    assert hub.head(REPO).message == "someone else"
    assert not (build / ".gkbuild" / "publish").exists()
