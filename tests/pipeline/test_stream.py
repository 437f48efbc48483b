"""``gkbuild compile RECIPE --to STORE``: tiny-topology from a moto S3 source into a moto S3 store on
24 MiB of local disk (the checkpoint is ~90 MB, the build ~120 MB), against ``compile`` + ``publish``
of the same recipe from the same source: every object of the store byte for byte, the same build
id; ``gkbuild fetch`` of it verifies. A killed streamed build leaves the store's index as it was,
and its rerun sends exactly the blobs that are missing (counted by the S3 server's own request
recorder). The limit is checked before anything is read or stored."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from pathlib import Path

import boto3
import pytest

from gkbuild import recipe
from gkbuild.publish import index, signing
from gkbuild.publish.fetch import fetch
from gkbuild.publish.publish import publish
from gkbuild.pipeline.stream import DiskWatch, stream_build
from tests.conftest import RECIPES, run_cli
from tests.s3server import moto_server

RECIPE = RECIPES / "tiny-topology-trn3.yaml"
SOURCE = "source=s3://src/ckpt"
LIMIT = 24 << 20


@pytest.fixture(scope="module")
def s3(topo_ckpt, tmp_path_factory):
    """A moto server of this module's own (its request recorder writes to a file of ours), holding
    the tiny-topology checkpoint under s3://src/ckpt."""
    rec = tmp_path_factory.mktemp("moto") / "recording.jsonl"
    with moto_server(recording=str(rec)) as url:
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="src")
        for p in sorted(topo_ckpt.iterdir()):
            client.upload_file(str(p), "src", f"ckpt/{p.name}")
        yield url, client


def objects(client, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) + 1:]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


@pytest.fixture(scope="module")
def reference(s3, tmp_path_factory):
    """compile + publish of the recipe from the same S3 source: the store's objects, the build id."""
    _, client = s3
    client.create_bucket(Bucket="ref")
    out = tmp_path_factory.mktemp("ref") / "build"
    # both as a user runs them, in processes of their own (as the streamed build is): what earlier
    # tests left imported in this worker (a fake Neuron SDK, say) must not change the reference
    for args in (("compile", str(RECIPE), "--set", SOURCE, "--out", str(out), "-q"),
                 ("publish", str(out), "--to", "s3://ref/b", "-q")):
        r = run_cli(*args)
        assert r.returncode == 0, r.stderr
    return objects(client, "ref", "b"), json.loads((out / "manifest.json").read_text())["build_id"]


def local(tmp_path) -> dict:
    """A private $GKBUILD_CACHE and $TMPDIR: every byte the build puts on local disk lands there."""
    env = {"GKBUILD_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
    for d in env.values():
        os.makedirs(d)
    return env


def stream(to: str, env: dict, *extra: str):
    return run_cli("compile", str(RECIPE), "--set", SOURCE, "--to", to, "--scratch-limit", "24MiB", "--json",
                   *extra, env=env)


def _recorder(url: str, what: str) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/recorder/{what}",
                                                       method="GET" if what.startswith("download") else "POST")) as r:
        return r.read()


@pytest.mark.slow
def test_a_killed_streamed_build_resumes_into_compile_and_publish_byte_for_byte(s3, reference, built, topo_ckpt,
                                                                                tmp_path):
    """One streamed build, killed mid-stream, then run again: the store's index stays the other
    build's until the rerun commits; the rerun sends exactly the blobs the store lacks; the result
    is compile + publish's, byte for byte, with the same build id; local disk never passed 24 MiB."""
    url, client = s3
    client.create_bucket(Bucket="dst")
    publish(built, "s3://dst/b", quiet=True)  # the store holds another build: its index must survive the kill
    before = client.get_object(Bucket="dst", Key="b/publish.json")["Body"].read()
    theirs = set(objects_names(client, "dst", "b/blobs/"))
    env = local(tmp_path)
    with DiskWatch(*map(Path, env.values())) as disk:  # a sampler of its own, in this process
        p = subprocess.Popen([sys.executable, "-m", "gkbuild", "compile", str(RECIPE), "--set", SOURCE, "--to",
                              "s3://dst/b", "--scratch-limit", "24MiB", "-q", "--jobs", "1"],
                             env=dict(os.environ, **env), start_new_session=True, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            if len(set(objects_names(client, "dst", "b/blobs/")) - theirs) >= 40:
                break
            time.sleep(0.2)
        assert p.poll() is None, p.stderr.read()
        os.killpg(p.pid, signal.SIGKILL)  # the build and its workers, mid-stream
        p.wait()
        p.stderr.close()
        assert client.get_object(Bucket="dst", Key="b/publish.json")["Body"].read() == before
        present = {k.removeprefix("b/") for k in objects_names(client, "dst", "b/blobs/")}

        _recorder(url, "reset-recording")
        _recorder(url, "start-recording")
        try:
            r = stream("s3://dst/b", env)
        finally:
            _recorder(url, "stop-recording")
    assert r.returncode == 0, r.stderr
    puts = recorded(_recorder(url, "download-recording").decode())
    sent = sorted("blobs/" + e["url"].split("/blobs/", 1)[1].split("?")[0] for e in puts
                  if e["method"] == "PUT" and "/dst/b/blobs/" in e["url"])
    ref_objects, ref_id = reference
    final = index.parse(client.get_object(Bucket="dst", Key="b/publish.json")["Body"].read(), "index")
    missing = sorted(index.blobs(final) - present)
    assert 0 < len(missing) < len(index.blobs(final))  # the kill came mid-stream
    assert sent == missing  # each missing blob sent once, nothing already there sent again
    # the result: compile + publish's index and every blob it names, byte for byte, the same build id
    st = json.loads(r.stdout)["stream"]
    assert json.loads(r.stdout)["build_id"] == final["build_id"] == ref_id
    got = objects(client, "dst", "b")
    assert {k: got[k] for k in [index.NAME, *index.blobs(final)]} == ref_objects
    assert sum(f.stat().st_size for f in topo_ckpt.iterdir()) > 3 * LIMIT  # far above the limit
    assert 2 << 20 <= st["peak_disk"] <= LIMIT  # it measured its staging (the embedding shard is 2 MiB)
    assert 0 < disk.peak <= LIMIT
    assert not (tmp_path / "cache" / "s3").exists()  # the source was read by range, never mirrored
    weights = [f for f in topo_ckpt.iterdir() if f.suffix == ".safetensors" or f.name.endswith(".json")
               and f.name in ("config.json", "model.safetensors.index.json")]
    assert st["source_bytes"] == sum(f.stat().st_size for f in weights)
    fetched = run_cli("fetch", "s3://dst/b", "--to", str(tmp_path / "fetched"), "--expect", ref_id)
    assert fetched.returncode == 0, fetched.stderr
    assert run_cli("check", str(tmp_path / "fetched")).returncode == 0


def recorded(text: str) -> list[dict]:
    """The recorder's entries: one JSON object a request, written by the server's threads with
    O_APPEND (an entry is whole; two may share a line when their newlines interleave)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while (i := len(text) - len(text[i:].lstrip())) < len(text):
        e, i = dec.raw_decode(text, i)
        out.append(e)
    return out


def objects_names(client, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]


@pytest.mark.slow
def test_a_streamed_build_from_s3_reads_each_source_byte_about_once(s3, topo_ckpt, tmp_path):
    """The bytes a streamed build reads by range, against the source's tensors. Each TP rank reads
    only its heads' rows of q/k/v and the sinks, and each shard its own rows of the rest, so every
    tensor byte is read once, but o_proj: every rank reads it whole (its columns are 1/tp of each
    row; one GET of the whole tensor is cheaper than a GET a row: ``emit._attn``), tp times at
    most (a worker's memo of recent ranges may serve a later rank's). So the ranges lie between
    the tensors' bytes and that plus (tp - 1) o_projs: 1.27x of the tensors for this model.
    (``test_emit_reads`` counts a rank's reads exactly, without the memo.) A fresh cache also
    hashes each file whole, once (``source_hashed``)."""
    from gkbuild.checkpoint.reader import Checkpoint
    from gkbuild.layout.dims import Dims

    _, client = s3
    client.create_bucket(Bucket="reads")
    r = stream("s3://reads/b", local(tmp_path))
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)["stream"]
    ck = Checkpoint.open(topo_ckpt)
    dims = Dims.of(ck.config, tp=recipe.load(RECIPE).topology.tp)
    assert dims.kv >= dims.tp  # no kv head is replicated over ranks: each k/v row has one reader
    tensors = sum(i.nbytes for i in ck.where.values())
    o_proj = sum(i.nbytes for n, i in ck.where.items() if n.endswith("self_attn.o_proj.weight"))
    assert st["source_hashed"] == st["source_bytes"]  # a fresh cache: every file hashed, whole, once
    ranges = st["source_read"] - st["source_hashed"]
    assert tensors <= ranges <= tensors + (dims.tp - 1) * o_proj, (ranges / tensors, o_proj / tensors)


def test_a_scratch_limit_that_cannot_stage_the_largest_shard_is_refused_up_front(topo_ckpt, tmp_path):
    env = local(tmp_path)
    r = run_cli("compile", str(RECIPE), "--set", f"source={topo_ckpt}", "--to", str(tmp_path / "store"),
                "--scratch-limit", "2MiB", env=env)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--scratch-limit 2.00 MiB" in lines[0] and "weights/embed-host.safetensors" in lines[0]
    assert not (tmp_path / "store").exists()  # nothing stored, no lease left


def test_into_a_folder_store_signed_with_a_key_it_equals_a_signed_publish(built, tmp_path):
    """From a memory-mapped source (synth://) into a folder store, signed as publish --sign signs:
    every file of the store but the signature (ECDSA draws a fresh nonce) equals a signed publish of
    the same recipe's build; the signature verifies and a fetch that trusts the key gets the build."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    k = ec.generate_private_key(ec.SECP256R1())
    pem, pub = tmp_path / "ci.pem", tmp_path / "ci.pub"
    pem.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo))
    res = stream_build(recipe.load(RECIPES / "tiny-cpu.yaml"), str(tmp_path / "store"), 64 << 20, quiet=True,
                       compile=False, sign=str(pem))
    ref = tmp_path / "ref-build"
    shutil.copytree(built, ref)
    publish(ref, str(tmp_path / "ref"), quiet=True, sign=str(pem))
    got_idx, ref_idx = (json.loads((tmp_path / s / index.NAME).read_text()) for s in ("store", "ref"))
    sig = {ref_idx["signature"]["blob"], got_idx["signature"]["blob"]}
    assert res.manifest["build_id"] == ref_idx["build_id"] == got_idx["build_id"]
    assert {k: v for k, v in got_idx.items() if k != "signature"} == {k: v for k, v in ref_idx.items()
                                                                      if k != "signature"}
    tree = {s: {p.relative_to(tmp_path / s).as_posix(): p.read_bytes() for p in (tmp_path / s).rglob("*")
                if p.is_file() and p.relative_to(tmp_path / s).as_posix() not in sig | {index.NAME}}
            for s in ("store", "ref")}
    assert tree["store"] == tree["ref"] and len(tree["store"]) == len(ref_idx["files"]) + 2  # + manifest, provenance
    got = fetch(str(tmp_path / "store"), tmp_path / "got", quiet=True, trust=signing.trust_list([str(pub)]))
    assert got["signed_by"] == f"key {pub}"


@pytest.mark.slow
def test_a_prune_during_a_streamed_build_removes_none_of_its_blobs(built, topo_ckpt, tmp_path):
    """A folder store holding another build; mid-stream, another publish commits with --prune: the
    streamed build's blobs (in no index yet) stay, kept by its lease; the build then commits."""
    from gkbuild.pipeline.pipeline import compile_build

    store = tmp_path / "store"
    other = tmp_path / "other"
    shutil.copytree(built, other)
    publish(built, str(store), quiet=True)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=other, quiet=True, compile=False)
    theirs = {p.name for p in (store / "blobs").iterdir()}
    env = local(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "gkbuild", "compile", str(RECIPE), "--set", f"source={topo_ckpt}",
                          "--to", str(store), "--scratch-limit", "24MiB", "-q", "--jobs", "1", "--no-compile"],
                         env=dict(os.environ, **env), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline and \
            len({q.name for q in (store / "blobs").iterdir()} - theirs) < 3:
        time.sleep(0.05)
    mine = {q.name for q in (store / "blobs").iterdir() if not q.name.startswith(".")} - theirs
    rep = publish(other, str(store), quiet=True, prune=True)
    assert p.poll() is None, "the streamed build ended before the prune: nothing was tested"
    assert rep["pruned"] == 0 and mine <= {q.name for q in (store / "blobs").iterdir()}
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    final = index.parse((store / index.NAME).read_bytes(), "index")
    assert {f"blobs/{n}" for n in mine} <= index.blobs(final)  # they were the streamed build's, kept for it
    fetch(str(store), tmp_path / "got", quiet=True)
    assert run_cli("check", str(tmp_path / "got")).returncode == 0
