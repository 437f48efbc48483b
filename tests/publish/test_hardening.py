"""fetch resume after kills at any moment, hostile fetch records, rotten store blobs, interrupted
publishes' temporaries, oversized indexes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gkbuild.errors import GkError
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.check import problems
from gkbuild.publish import index
from gkbuild.publish.fetch import fetch
from gkbuild.publish.publish import publish
from gkbuild.publish.stores import MAX_INDEX
from gkbuild import recipe
from gkbuild.pipeline.pipeline import compile_build
from tests.conftest import RECIPES, run_cli


@pytest.fixture(scope="module")
def store(built, tmp_path_factory):
    s = tmp_path_factory.mktemp("store") / "s"
    publish(built, str(s), quiet=True)
    return s


def test_a_fetch_record_naming_a_path_outside_is_set_aside_never_followed(store, tmp_path):
    victim = tmp_path / "x"
    victim.write_text("keep me")
    dest = tmp_path / "a" / "b"
    (dest / ".gkbuild").mkdir(parents=True)
    (dest / ".gkbuild" / "fetch.json").write_text(json.dumps({"build_id": "0", "files": {"../../x": [7, 0, "0"]}}))
    fetch(str(store), dest, quiet=True)
    assert victim.read_text() == "keep me"
    assert problems(dest) == []


def test_a_file_in_place_but_unrecorded_is_reverified_not_refused(store, built, tmp_path):
    """The kill landed between moving a file into place and recording it."""
    dest = tmp_path / "d"
    (dest / "weights").mkdir(parents=True)
    (dest / "weights" / "expert-000.safetensors").write_bytes((built / "weights" / "expert-000.safetensors").read_bytes())
    (dest / ".gkbuild" / "fetch").mkdir(parents=True)
    (dest / ".gkbuild" / "fetch" / f".{'a' * 32}.1.partial").write_text("torn")  # a leftover temporary
    rep = fetch(str(store), dest, quiet=True)
    assert rep["reused_files"] == 1
    assert problems(dest) == [] and not (dest / ".gkbuild").exists()


def test_a_foreign_file_in_place_is_named_and_kept(store, tmp_path):
    dest = tmp_path / "d"
    (dest / "weights").mkdir(parents=True)
    (dest / "weights" / "expert-000.safetensors").write_text("mine")
    r = run_cli("fetch", str(store), "--to", str(dest), "-q")
    assert r.returncode == 1
    assert r.stderr.strip() == (f"gkbuild: error: {dest}: holds weights/expert-000.safetensors, which no fetch "
                                f"verified (its content is not the manifest's); fetch into a new or empty folder")
    assert (dest / "weights" / "expert-000.safetensors").read_text() == "mine"
    (tmp_path / "f").write_text("x")
    r = run_cli("fetch", str(store), "--to", str(tmp_path / "f"), "-q")
    assert r.returncode == 1 and "f: exists and is not a folder" in r.stderr and (tmp_path / "f").read_text() == "x"


@pytest.fixture(scope="module")
def signed_store(built, tmp_path_factory):
    """The tiny build published signed: a fetch writes its signature and provenance last, beside the manifest."""
    import shutil

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    d = tmp_path_factory.mktemp("signed")
    key = d / "ci.pem"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    b = d / "b"
    shutil.copytree(built, b)
    publish(b, str(d / "s"), quiet=True, sign=str(key))
    return d / "s"


def test_a_fetch_killed_inside_any_write_always_resumes(signed_store, tmp_path):
    """Killed just before each kind of rename into place (a file, its record, the signature, the
    provenance, the manifest last): the rerun finishes, and the build checks. It used to refuse for
    ever after a kill inside the manifest's own write (``.manifest.json.<pid>.partial``)."""
    def fetch_killed_at(k: int, dest):
        return subprocess.run([sys.executable, "-m", "tests.publish.killed_at", str(k), "fetch", str(signed_store),
                               "--to", str(dest), "-q"], capture_output=True, text=True)

    counted = fetch_killed_at(0, tmp_path / "count")
    assert counted.returncode == 0, counted.stderr
    n = int(counted.stderr.split("renames ")[-1])
    assert n > 8  # every file, each record write, signature, provenance and manifest
    for k in sorted({1, 2, 3, n // 2, n - 3, n - 2, n - 1, n}):
        dest = tmp_path / f"d{k}"
        killed = fetch_killed_at(k, dest)
        assert killed.returncode == -signal.SIGKILL, (k, killed.stderr)
        assert not (dest / mf.NAME).exists()  # the manifest is the last thing to land
        r = run_cli("fetch", str(signed_store), "--to", str(dest), "-q")
        assert r.returncode == 0, f"killed at rename {k} of {n}: {r.stderr}"
        assert problems(dest) == [] and not [p for p in dest.rglob("*.partial")]


def test_a_rotten_blob_is_not_trusted_and_republishing_repairs_it(built, tmp_path):
    s = tmp_path / "s"
    publish(built, str(s), quiet=True)
    idx = json.loads((s / index.NAME).read_text())
    e = next(f for f in idx["files"] if f["path"] == "weights/attn-tp0.safetensors")
    blob = s / e["blob"]
    blob.write_bytes(blob.read_bytes()[:-1] + bytes([blob.read_bytes()[-1] ^ 1]))
    rep = publish(built, str(s), quiet=True)
    assert rep["already"] is False and rep["uploaded_files"] == 1
    fetch(str(s), tmp_path / "d", quiet=True)
    assert problems(tmp_path / "d") == []


def test_prune_judges_publishes_in_progress_by_leases_in_the_store_not_by_pid(build, tmp_path):
    s = tmp_path / "s"
    publish(build, str(s), quiet=True)
    first = set(os.listdir(s / "blobs"))
    torn = s / "blobs" / f".{'b' * 64}.zst.{os.getpid()}.partial"  # a live pid on this host, yet no lease
    torn.write_text("torn")
    other = s / "leases" / f"{'a' * 32}.json"  # another host's publish, alive
    assert (s / "leases").is_dir()
    other.write_text(json.dumps({"owner": "a" * 32, "host": "elsewhere", "pid": 1, "expires": time.time() + 600}))
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    rep = publish(build, str(s), prune=True, quiet=True)  # a new index: --prune runs
    assert rep["pruned"] == 0 and torn.exists() and first <= set(os.listdir(s / "blobs"))
    other.write_text(json.dumps({"owner": "a" * 32, "host": "elsewhere", "pid": 1, "expires": time.time() - 1}))
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=32"]), out=build, quiet=True, compile=False)
    rep = publish(build, str(s), prune=True, quiet=True)  # that publish died: its lease expired
    assert rep["pruned"] > 0 and not torn.exists() and not other.exists()
    assert {f"blobs/{n}" for n in os.listdir(s / "blobs")} == index.blobs(json.loads((s / index.NAME).read_text()))
    assert os.listdir(s / "leases") == []  # this publish's own lease is gone too


def test_an_oversized_index_is_not_read(store, tmp_path):
    s = tmp_path / "s"
    s.mkdir()
    with open(s / index.NAME, "wb") as f:
        f.truncate(MAX_INDEX + 1)  # sparse: no disk used
    with pytest.raises(GkError, match=r"publish.json: 268435457 bytes; a publish index is never over"):
        fetch(str(s), tmp_path / "d", quiet=True)


def test_a_malformed_or_far_future_lease_is_named_blocks_for_a_bounded_time_and_can_be_cleared(build, tmp_path,
                                                                                             capsys):
    from gkbuild.publish.leases import SKEW, TTL, Lease
    from gkbuild.publish.publish import prune_store
    from gkbuild.publish.stores import open_store

    s = tmp_path / "s"
    publish(build, str(s), quiet=True)
    orphan = s / "blobs" / f"{'0' * 64}.raw"  # a blob no index names: what a prune removes
    orphan.write_text("old")
    far = s / "leases" / f"{'f' * 32}.json"  # a publish from a clock years ahead, or a hand
    years = 10 * 365 * 86400
    far.write_text(json.dumps({"owner": "f" * 32, "host": "skewed", "pid": 7, "expires": time.time() + years}))
    bad = s / "leases" / f"{'b' * 32}.json"
    bad.write_text("{not json")
    capsys.readouterr()
    store = open_store(s)
    assert prune_store(store, Lease(store)) == 0 and orphan.exists()  # fresh: both count as publishes in progress
    err = " ".join(capsys.readouterr().err.split())
    assert "2 publish(es) in progress hold a lease, leases/bbbb" in err and "malformed" in err
    assert f"gkbuild leases {s} --clear leases/{'b' * 32}.json" in err
    r = run_cli("cache", "prune", str(s))  # the compile cache's prune says why it removed nothing, too
    said = " ".join(r.stderr.split())
    assert r.returncode == 0 and "blobs not pruned: 2 publish(es) in progress hold a lease" in said
    held = {h["name"]: h for h in json.loads(run_cli("leases", str(s), "--json").stdout)}
    assert held[f"leases/{far.name}"]["live"] and "beyond any lease" in held[f"leases/{far.name}"]["problem"]
    assert held[f"leases/{far.name}"]["until"] <= time.time() + TTL + SKEW  # bounded by when it was written
    old = time.time() - TTL - SKEW - 60  # both written longer ago than a live publish's lease ever is
    for p in (far, bad):
        os.utime(p, (old, old))
    assert prune_store(store, Lease(store)) == 1 and not orphan.exists()
    assert not far.exists()  # a lease record past its (bounded) expiry: a dead publish's, removed
    assert bad.read_text() == "{not json"  # not a record gkbuild writes: kept until cleared, but no longer blocking
    refused = run_cli("leases", str(s), "--clear", "leases/../publish.json")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "not a lease name" in refused.stderr
    cleared = run_cli("leases", str(s), "--clear", f"leases/{bad.name}")
    assert cleared.returncode == 0 and not bad.exists() and (s / index.NAME).exists()
    assert "no leases" in run_cli("leases", str(s)).stderr


def test_of_two_publishes_to_one_folder_the_second_to_commit_is_refused_and_a_replacement_is_said(built, build,
                                                                                               tmp_path, monkeypatch):
    from gkbuild.publish.stores import DirStore

    s = tmp_path / "s"
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    real = DirStore.commit

    def raced(self, *a):  # another publish commits between this one's reading the index and its commit
        monkeypatch.setattr(DirStore, "commit", real)
        publish(built, str(s), quiet=True)
        return real(self, *a)

    monkeypatch.setattr(DirStore, "commit", raced)
    with pytest.raises(GkError, match="another publish committed since this one read the index; nothing of this "
                                      "publish is visible"):
        publish(build, str(s), quiet=True)
    assert json.loads((s / index.NAME).read_text())["build_id"] == mf.load(built)["build_id"]  # the first commit stands
    r = run_cli("publish", str(build), "--to", str(s))  # over the index it reads: replaces the build, says so
    said = " ".join(r.stderr.split())
    assert r.returncode == 0 and f"it replaces build 'tiny-cpu' {mf.load(built)['build_id'][:16]} " in said
    assert json.loads((s / index.NAME).read_text())["build_id"] == mf.load(build)["build_id"]


def _lease_of_this_host(s, owner: str, pid: int) -> "os.PathLike":
    import socket

    from gkbuild.publish.leases import boot_id

    p = s / "leases" / f"{owner * 32}.json"
    p.write_text(json.dumps({"owner": owner * 32, "host": socket.gethostname(), "boot": boot_id(), "pid": pid,
                             "expires": time.time() + 600}))
    return p


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_clearing_the_lease_of_a_publish_running_on_this_host_needs_force(build, tmp_path):
    s = tmp_path / "s"
    publish(build, str(s), quiet=True)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as running:
        try:
            lease = _lease_of_this_host(s, "c", running.pid)
            r = run_cli("leases", str(s), "--clear", f"leases/{lease.name}")
            assert r.returncode == 1 and r.stderr.count("\n") == 1 and "running now on this host" in r.stderr
            assert "--force" in r.stderr and lease.exists()
            r = run_cli("leases", str(s), "--clear", f"leases/{lease.name}", "--force")
            assert r.returncode == 0 and not lease.exists(), r.stderr
        finally:
            running.kill()


def test_a_rerun_on_this_host_reclaims_a_dead_publishs_lease_and_partials(build, tmp_path):
    """A killed publish (or streamed build) of this host leaves its lease, unexpired, and blob
    temporaries: the next successful publish there removes both (its process is gone), and a prune
    is not blocked by it."""
    s = tmp_path / "s"
    publish(build, str(s), quiet=True)
    pid = _dead_pid()
    lease = _lease_of_this_host(s, "d", pid)
    torn = s / "blobs" / f".{'d' * 64}.zst.{pid}.partial"
    torn.write_text("torn")
    rep = publish(build, str(s), quiet=True)  # the store holds the build already
    assert rep["already"] and rep["tidied"] == 2 and not lease.exists() and not torn.exists()
    assert os.listdir(s / "leases") == []
    lease = _lease_of_this_host(s, "e", _dead_pid())
    assert "expires in" in run_cli("leases", str(s)).stderr  # listed, but judged dead by a prune:
    orphan = s / "blobs" / f"{'0' * 64}.raw"
    orphan.write_text("old")
    rep = publish(build, str(s), prune=True, quiet=True)
    assert rep["pruned"] == 1 and not orphan.exists() and not lease.exists()


def test_publish_prune_prunes_when_the_store_already_holds_the_build(build, tmp_path):
    """It used to return before pruning: junk blobs and dead temporaries stayed, rc 0, nothing said."""
    s = tmp_path / "s"
    publish(build, str(s), quiet=True)
    junk = s / "blobs" / f"{'1' * 64}.zst"
    junk.write_text("junk")
    torn = s / "blobs" / f".{'2' * 64}.raw.{_dead_pid()}.partial"
    torn.write_text("torn")
    rep = publish(build, str(s), prune=True, quiet=True)
    assert rep["already"] and rep["pruned"] == 2 and not junk.exists() and not torn.exists()
    assert {f"blobs/{n}" for n in os.listdir(s / "blobs")} == index.blobs(json.loads((s / index.NAME).read_text()))
