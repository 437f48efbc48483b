"""The s3 store against a real S3 server (moto on 127.0.0.1): publish and fetch round-trip, the
folder store's refusals from a hostile bucket, the concurrent-publish race decided by conditional
writes, multipart uploads that resume part by part, and fetch resume."""

import shutil

import pytest
import s3fs

from gkbuild import recipe, s3
from gkbuild.errors import GkError
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.publish import codec, index
from gkbuild.publish.fetch import fetch
from gkbuild.publish.publish import publish
from gkbuild.publish.s3 import S3Store
from tests.conftest import RECIPES, run_cli
from tests.publish.test_publish_fetch import REFUSALS, _build_files, _only_verified


def _fs():
    return s3fs.S3FileSystem(use_listings_cache=False)


def _index_etag(uri: str) -> str:
    ref = s3.parse(uri)
    return _fs().info(ref.path(index.NAME))["ETag"]


def test_publish_then_fetch_through_s3(built, bucket, tmp_path):
    uri = f"s3://{bucket}/builds/tiny"
    rep = publish(built, uri, quiet=True)
    m = mf.load(built)
    assert rep["uploaded_files"] == len(m["files"]) + 1 and rep["where"].startswith(f"{uri}/publish.json (ETag ")
    keys = _fs().find(f"{bucket}/builds/tiny")
    assert {k.split("/tiny/", 1)[1] for k in keys} == {index.NAME} | index.blobs(index.parse(
        _fs().cat(f"{bucket}/builds/tiny/{index.NAME}"), "x"))
    got = fetch(uri, tmp_path / "got", quiet=True)
    assert got["fetched_files"] == len(m["files"]) and problems(tmp_path / "got") == []
    assert _build_files(tmp_path / "got") == _build_files(built)
    etag = _index_etag(uri)
    assert publish(built, uri, quiet=True)["already"]  # nothing uploaded, the index untouched
    assert _index_etag(uri) == etag


def test_a_change_uploads_only_what_changed_and_prune_drops_the_rest(build, bucket):
    uri = f"s3://{bucket}/b"
    publish(build, uri, quiet=True)
    n = len(S3Store(s3.parse(uri)).stored())
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    assert publish(build, uri, quiet=True)["uploaded_files"] == 2
    store = S3Store(s3.parse(uri))
    assert len(store.stored()) == n + 2
    publish(build, uri, quiet=True, prune=False)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=32"]), out=build, quiet=True, compile=False)
    publish(build, uri, quiet=True, prune=True)
    assert set(store.stored()) == index.blobs(index.parse(store.read_index(), "x"))


@pytest.mark.parametrize("case", [c for c in REFUSALS if c != "symlinked blob"])  # a bucket has no symlinks
def test_a_hostile_bucket_is_refused_like_a_folder_store(case, built, bucket, tmp_path):
    local = tmp_path / "crafted"
    publish(built, str(local), quiet=True)
    craft, message = REFUSALS[case]
    craft(local)
    _fs().put(str(local) + "/", f"{bucket}/x", recursive=True)
    dest = tmp_path / "got"
    with pytest.raises(GkError, match=message):
        fetch(f"s3://{bucket}/x", dest, quiet=True, jobs=1)
    _only_verified(dest, mf.load(built))


def test_a_blob_missing_from_the_bucket_and_an_oversized_index_are_refused(built, bucket, tmp_path):
    uri = f"s3://{bucket}/x"
    publish(built, uri, quiet=True)
    idx = index.parse(_fs().cat(f"{bucket}/x/{index.NAME}"), "x")
    _fs().rm(f"{bucket}/x/{idx['files'][0]['blob']}")
    with pytest.raises(GkError, match="a blob is missing from the store"):
        fetch(uri, tmp_path / "a", quiet=True, jobs=1)
    with pytest.raises(GkError, match="refusing to read more than 10"):
        S3Store(s3.parse(uri)).get(index.NAME, limit=10)


def test_locations_that_are_not_stores_are_one_clear_line(built, bucket, s3_server, tmp_path):
    with pytest.raises(GkError, match="no publish.json"):
        fetch(f"s3://{bucket}/nothing", tmp_path / "a", quiet=True)
    with pytest.raises(GkError, match="the bucket does not exist"):
        fetch("s3://no-such-bucket-here/x", tmp_path / "a", quiet=True)
    with pytest.raises(GkError, match="expected s3://BUCKET"):
        fetch("s3://Not_A_Bucket/x", tmp_path / "a", quiet=True)
    with pytest.raises(GkError, match="expected s3://BUCKET"):
        publish(built, f"s3://{bucket}/a/../b", quiet=True)
    _fs().pipe(f"{bucket}/home/notes.txt", b"mine")
    with pytest.raises(GkError, match="not empty and not a gkbuild store"):
        publish(built, f"s3://{bucket}/home", quiet=True)
    assert _fs().find(f"{bucket}/home") == [f"{bucket}/home/notes.txt"]
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("first", [True, False], ids=["empty store", "over a previous build"])
def test_of_two_concurrent_publishers_the_second_to_commit_is_refused(first, build, bucket, tmp_path, monkeypatch):
    """Both read the same index (or none); the other commits between this one's read and its
    commit; S3 refuses this one's conditional write, and the store holds the other's build whole."""
    uri = f"s3://{bucket}/race"
    if not first:
        publish(build, uri, quiet=True)
    other = tmp_path / "other"
    shutil.copytree(build, other)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=other, quiet=True, compile=False)
    real = S3Store.commit

    def the_other_lands_first(self, *a, **k):
        monkeypatch.setattr(S3Store, "commit", real)
        publish(other, uri, quiet=True)
        return real(self, *a, **k)

    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=32"]), out=build, quiet=True, compile=False)
    monkeypatch.setattr(S3Store, "commit", the_other_lands_first)
    with pytest.raises(GkError, match="another publish committed since this one read the index"):
        publish(build, uri, quiet=True)
    got = fetch(uri, tmp_path / "got", quiet=True)
    assert got["build_id"] == mf.load(other)["build_id"] and problems(tmp_path / "got") == []
    publish(build, uri, quiet=True)  # run again: it reads the new index and wins
    assert index.parse(S3Store(s3.parse(uri)).read_index(), "x")["build_id"] == mf.load(build)["build_id"]


def test_an_interrupted_multipart_upload_resumes_part_by_part(build, bucket, monkeypatch):
    uri = f"s3://{bucket}/mp"
    monkeypatch.setattr(s3, "PART", s3.MIN_PART)
    expert = next(f for f in mf.load(build)["files"] if f["path"].startswith("weights/expert"))
    uploads, real_part, real_close = [], s3.Upload._part, s3.Upload.close
    calls = []

    def fail_on_third_part(self, data):
        if expert["sha256"] in self.name:
            calls.append(1)
            if len(calls) == 3:
                raise ConnectionResetError("network gone")
        return real_part(self, data)

    monkeypatch.setattr(s3.Upload, "_part", fail_on_third_part)
    with pytest.raises(GkError, match="network gone"):
        publish(build, uri, quiet=True, jobs=1)
    assert S3Store(s3.parse(uri)).read_index() is None  # nothing visible
    monkeypatch.setattr(s3.Upload, "_part", real_part)
    monkeypatch.setattr(s3.Upload, "close", lambda self: (uploads.append(self), real_close(self))[1])
    publish(build, uri, quiet=True, jobs=1)
    big = next(u for u in uploads if expert["sha256"] in u.name)
    assert big.reused == 2 and big.sent == len(big.parts) - 2 >= 2, (big.reused, big.sent, len(big.parts))
    listed = _fs().call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert listed == []  # the resumed upload was completed, none left behind


def test_an_interrupted_fetch_from_s3_resumes(built, bucket, tmp_path, monkeypatch):
    uri = f"s3://{bucket}/f"
    publish(built, uri, quiet=True)
    real, done = codec.decode, []

    def interrupt_third(src, dst, encoding, size, stored_size, where, *a, **k):
        if "(the manifest)" not in where:
            if len(done) == 2:
                raise KeyboardInterrupt
            done.append(where)
        return real(src, dst, encoding, size, stored_size, where, *a, **k)

    monkeypatch.setattr(codec, "decode", interrupt_third)
    with pytest.raises(KeyboardInterrupt):
        fetch(uri, tmp_path / "got", quiet=True, jobs=1)
    monkeypatch.setattr(codec, "decode", real)
    rep = fetch(uri, tmp_path / "got", quiet=True, jobs=1)
    assert rep["reused_files"] == 2 and problems(tmp_path / "got") == []


def test_cli_publish_fetch_and_diff_through_s3(built, bucket, tmp_path):
    uri = f"s3://{bucket}/cli"
    r = run_cli("publish", str(built), "--to", uri, "-q")
    assert r.returncode == 0, r.stderr
    r = run_cli("fetch", uri, "--to", str(tmp_path / "d"), "-q", "--expect", mf.load(built)["build_id"][:12])
    assert r.returncode == 0, r.stderr
    assert run_cli("diff", str(built), uri).returncode == 0
    r = run_cli("fetch", f"s3://{bucket}/none", "--to", str(tmp_path / "e"))
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"gkbuild: error: s3://{bucket}/none: no publish.json (not a gkbuild store, or nothing published there yet)"]


def test_a_query_or_odd_character_in_the_location_is_refused_before_anything_is_written(built, bucket):
    for uri in (f"s3://{bucket}/p?versionId=x", f"s3://{bucket}/p#frag", f"s3://{bucket}/a b", f"s3://{bucket}/p%2F"):
        with pytest.raises(GkError, match=r"in the prefix: .*expected s3://BUCKET\[/PREFIX\]"):
            publish(built, uri, quiet=True)
    assert _fs().find(bucket) == []  # not even a lease under the literal key
    r = run_cli("compile", str(RECIPES / "tiny-cpu.yaml"), "--cache", f"s3://{bucket}/c?versionId=1", "--out",
                str(built.parent / "never"))
    assert r.returncode == 1 and "a query or fragment is not part of a location" in r.stderr
    assert not (built.parent / "never").exists()


def test_an_s3_lease_dated_far_ahead_is_bounded_by_when_the_server_wrote_it(bucket):
    import json
    import time

    from gkbuild.publish.leases import SKEW, TTL, leases

    store = S3Store(s3.parse(f"s3://{bucket}/st"))
    name = f"leases/{'a' * 32}.json"
    store.put(name, json.dumps({"owner": "a" * 32, "host": "h", "pid": 1, "expires": time.time() + 1e9}).encode())
    (held,) = leases(store)
    written = store.modified("leases")[name]
    assert abs(written - time.time()) < 120 and held.until == written + TTL + SKEW and "beyond" in held.problem
