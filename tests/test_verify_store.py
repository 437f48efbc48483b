"""``gkbuild verify STORE``: tiny-topology (128 emulated ranks, ~120 MB of shards) verified where it
is published (a moto S3 store on 127.0.0.1, a folder store, the fake hub) with ``--scratch-limit
24MiB``: it passes, the local disk it adds ($GKBUILD_CACHE and $TMPDIR, polled from here) stays
under the limit, and its report is a local verify's of the fetched build field for field (timings
aside). A blob altered in the store fails in one line naming the file; with ``--trust`` the
signature is checked before any shard is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import zstandard

from gkbuild import recipe
from gkbuild.checkpoint.source import materialize, parse
from gkbuild.golden import default_prompts, for_checkpoint
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.pipeline.stream import DiskWatch
from gkbuild.publish import index
from gkbuild.publish.fetch import fetch
from gkbuild.publish.publish import publish
from gkbuild.reference import build_kv
from gkbuild.runtime import Build
from tests.conftest import RECIPES, ROOT
from tests.publish.conftest import unzstd
from tests.publish.fake_hub import FakeHub

LIMIT = 24 << 20
REPO = "my-org/gk-verify"

# the CLI in a process of its own, its store opened against the fake hub kept in a folder
# (argv[1]); the hub is reached as gkbuild's own hub store reaches huggingface_hub (api / fs)
ON_HUB = """
import sys
from pathlib import Path
from gkbuild.publish import shards, stores
from tests.publish.fake_hub import FakeHub
hub = FakeHub(Path(sys.argv[1]))
shards.open_store = lambda uri, api=None, fs=None: stores.open_store(uri, api=hub, fs=hub)
from gkbuild.cli import main
main(sys.argv[2:])
"""


@pytest.fixture(scope="module")
def topo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("topo") / "build"
    compile_build(recipe.load(RECIPES / "tiny-topology-trn3.yaml"), out=out, quiet=True, compile=False)
    return out


@pytest.fixture(scope="module")
def golden(topo, tmp_path_factory) -> Path:
    """2 sequences x (3 prompt + 2 steps), in the build's KV format (a few seconds to compute and to verify)."""
    g = for_checkpoint(materialize(parse("synth://tiny-topology?layers=2&seed=0")), default_prompts(2048, 2, 3), 2,
                       build_kv(Build.open(topo).manifest), quiet=True)
    p = tmp_path_factory.mktemp("golden") / "g.safetensors"
    g.save(p)
    return p


def cli(*args: str, env: dict, hub: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", ON_HUB, str(hub)] if hub is not None else [sys.executable, "-m", "gkbuild"]
    return subprocess.run([*cmd, *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
                          capture_output=True, text=True, timeout=600)


def private(tmp_path: Path) -> dict:
    """A private $GKBUILD_CACHE and $TMPDIR: whatever the verify puts on local disk lands there."""
    env = {"GKBUILD_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
    for d in env.values():
        os.makedirs(d)
    return env


def report(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    del d["stages"]  # timings
    del d["store_read"]  # where the bytes came from (checked apart)
    return d


@pytest.fixture(scope="module")
def local_report(topo, golden, s3_server, tmp_path_factory) -> tuple[str, dict]:
    """(build id, report) of a local verify of the build fetched back from an S3 store."""
    bucket = "gk-verify-fetched"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    publish(topo, f"s3://{bucket}/b", quiet=True)
    dest = tmp_path_factory.mktemp("fetched") / "build"
    rep = fetch(f"s3://{bucket}/b", dest, quiet=True)
    env = private(tmp_path_factory.mktemp("local"))
    return rep["build_id"], report(cli("verify", str(dest), "--golden", str(golden), "--json", "-q", env=env))


def _store(kind: str, topo: Path, tmp_path: Path, s3_server, sign: str | None = None):
    """(uri, hub folder or None, {path: a function that rewrites its blob}) of ``topo`` published."""
    if kind == "s3":
        bucket = f"gk-verify-{tmp_path.name.lower().replace('_', '-')}"[:60].strip("-")
        client = boto3.client("s3", endpoint_url=s3_server)
        client.create_bucket(Bucket=bucket)
        uri = f"s3://{bucket}/b"
        publish(topo, uri, quiet=True, sign=sign)
        idx = json.loads(client.get_object(Bucket=bucket, Key="b/publish.json")["Body"].read())

        def alter(blob: str, how=_flip) -> None:
            body = client.get_object(Bucket=bucket, Key=f"b/{blob}")["Body"].read()
            client.put_object(Bucket=bucket, Key=f"b/{blob}", Body=how(body))
        return uri, None, idx, alter
    if kind == "dir":
        store = tmp_path / "store"
        publish(topo, str(store), quiet=True, sign=sign)

        def alter(blob: str, how=_flip) -> None:
            (store / blob).write_bytes(how((store / blob).read_bytes()))
        return str(store), None, json.loads((store / index.NAME).read_text()), alter
    hub_dir = tmp_path / "hub"
    hub = FakeHub(hub_dir)
    uri = f"hf://{REPO}@trn3"
    publish(topo, uri, api=hub, fs=hub, quiet=True, sign=sign)
    head = hub.head(REPO, "trn3")
    idx = json.loads(head.tree[index.NAME])

    def alter(blob: str, how=_flip) -> None:  # the content the hub keeps for that file, changed at rest
        p = hub_dir / "objects" / head.files[blob]
        p.write_bytes(how(p.read_bytes()))
    return uri, hub_dir, idx, alter


def _flip(data: bytes) -> bytes:
    """One byte past the middle changed (a blob that rotted: zstd's own checksum catches it)."""
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]


def _forged(stored: bytes) -> bytes:
    """A zstd blob whose content has one byte changed, compressed again as a forger would (only the
    sha256 against the manifest catches it)."""
    return zstandard.ZstdCompressor(write_checksum=True).compress(_flip(unzstd(stored)))


@pytest.mark.parametrize("kind", ["s3", "dir", "hf"])
def test_verify_in_place_is_the_fetched_builds_verify_on_bounded_disk(kind, topo, golden, local_report, s3_server,
                                                                       tmp_path):
    uri, hub, _, _ = _store(kind, topo, tmp_path, s3_server)
    env = private(tmp_path)
    with DiskWatch(*map(Path, env.values())) as disk:
        r = cli("verify", uri, "--golden", str(golden), "--scratch-limit", "24MiB", "--json", "-q", env=env, hub=hub)
    build_id, want = local_report
    assert report(r) == want
    # one hashing read of every blob, then each layer's frames again; a tiny layer is about a frame, so
    # the frames at its edges weigh (2.29x here; 1.98x at the 120b shape, bench/RESULTS.md)
    read = json.loads(r.stdout)["store_read"]
    assert read["stored"] < read["read"] <= 2.5 * read["stored"], read
    assert want["ok"] and want["experts"]["checked"] == 2 * 128  # every expert shard of both layers was read
    assert disk.peak < LIMIT, disk.peak
    rep = fetch(uri, tmp_path / "fetched", quiet=True, **({"api": FakeHub(hub), "fs": FakeHub(hub)} if hub else {}))
    assert rep["build_id"] == build_id  # the store holds the build the local verify ran on


@pytest.mark.parametrize("kind", ["s3", "dir", "hf"])
def test_a_blob_altered_in_the_store_fails_in_one_line_naming_the_file(kind, topo, golden, s3_server, tmp_path):
    uri, hub, idx, alter = _store(kind, topo, tmp_path, s3_server)
    """Re-compressed content, which only the hash against the manifest catches (and, in one store,
    a rotted byte, which zstd's checksum does)."""
    f = next(e for e in idx["files"] if e["path"] == "weights/expert-077.safetensors")
    assert f["encoding"] == "zstd"
    alter(f["blob"], _forged)
    r = cli("verify", uri, "--golden", str(golden), "--scratch-limit", "24MiB", "-q", env=private(tmp_path), hub=hub)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"{f['blob']} (weights/expert-077.safetensors): refused: sha256" in lines[0], lines
    if kind == "dir":
        g = next(e for e in idx["files"] if e["path"] == "weights/attn-tp3.safetensors")
        alter(g["blob"])
        r = cli("verify", uri, "--golden", str(golden), "-q", env=private(tmp_path / "rot"))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert f"{g['blob']} (weights/attn-tp3.safetensors): corrupt zstd data" in lines[0], lines


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    d = tmp_path_factory.mktemp("keys")
    for name in ("ci", "mallory"):
        k = ec.generate_private_key(ec.SECP256R1())
        (d / f"{name}.pem").write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
        (d / f"{name}.pub").write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    return {n: (str(d / f"{n}.pem"), str(d / f"{n}.pub")) for n in ("ci", "mallory")}


def test_with_trust_the_signature_is_checked_before_any_shard_is_read(topo, golden, local_report, keys, s3_server,
                                                                     tmp_path):
    """A signed build verifies with its signer trusted (the same report); trusting another key, it is
    refused on the signature even with every shard's blob altered: no shard was read before."""
    uri, _, idx, alter = _store("dir", topo, tmp_path, s3_server, sign=keys["ci"][0])
    ok = cli("verify", uri, "--golden", str(golden), "--trust", keys["ci"][1], "--json", "-q", env=private(tmp_path))
    assert report(ok) == local_report[1]
    for f in idx["files"]:
        if f["path"].startswith("weights/"):
            alter(f["blob"])
    bad = cli("verify", uri, "--golden", str(golden), "--trust", keys["mallory"][1], "-q",
              env=private(tmp_path / "bad"))
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 1 and len(lines) == 1, bad.stderr
    assert "not trusted" in lines[0] and "weights/" not in lines[0], lines


def test_a_shard_whose_header_is_not_the_manifests_is_named_by_blob_and_file(topo, tmp_path):
    """A forged manifest (its build id recomputed, so it parses) that gives a shard's tensor another
    shape: the file's bytes are the hash it names, its header is not what it says; the message
    names the store's blob and the build's file, as a build folder's names its path."""
    from gkbuild.errors import GkError
    from gkbuild.publish.shards import open_build
    from tests.publish.conftest import read_store, rewrite

    store = tmp_path / "store"
    publish(topo, str(store), quiet=True)
    idx, m = read_store(store)
    f = next(f for f in m["files"] if f["path"] == "weights/attn-tp5.safetensors")
    f["tensors"][0]["shape"][0] += 1
    rewrite(store, idx, m)
    build = open_build(str(store))
    try:
        with pytest.raises(GkError) as e:
            build.load_rank(5)
    finally:
        build.close()
    blob = next(x["blob"] for x in idx["files"] if x["path"] == f["path"])
    assert str(e.value) == f"{store}/{blob} (weights/attn-tp5.safetensors): tensor W_qkv does not match the manifest"


def test_a_store_is_verified_through_the_twins_only(topo, tmp_path):
    """The compiled programs, the NEFFs and a DI prefill run from a build folder: refused in one
    line saying to fetch, before the store is read."""
    from gkbuild import verify
    from gkbuild.errors import GkError

    store = tmp_path / "store"
    publish(topo, str(store), quiet=True)
    (store / index.NAME).write_bytes(b"not read")  # had the store been read, this would be the error
    for engine in ("compiled", "neuron"):
        with pytest.raises(GkError, match=rf"^{store}: a build verified where it is stored runs through the twins; "
                                          rf"fetch it \(gkbuild fetch\) for --engine {engine}$"):
            verify.run(str(store), engine=engine)


def test_a_folder_stores_raw_blobs_are_hashed_then_mapped_where_they_lie(topo, golden, local_report, tmp_path,
                                                                         monkeypatch):
    """A raw blob of a folder store (the 120b's expert shards: ~60 GB no host holds in memory) is
    hashed in one read and then mapped in place, not copied into memory; the verify is the same,
    and a blob altered at rest is still refused by name."""
    from gkbuild.publish import codec
    from gkbuild.publish.shards import open_build

    monkeypatch.setattr(codec, "choose", lambda path, level=codec.LEVEL: (codec.RAW, 1.0))
    store = tmp_path / "store"
    publish(topo, str(store), quiet=True)
    idx = json.loads((store / index.NAME).read_text())
    assert {e["encoding"] for e in idx["files"]} == {codec.RAW}
    r = cli("verify", str(store), "--golden", str(golden), "--scratch-limit", "24MiB", "--json", "-q",
            env=private(tmp_path))
    assert report(r) == local_report[1]
    build = open_build(str(store))
    try:
        for e in idx["files"]:
            held = build.file(e["path"])
            assert os.readlink(os.fspath(held)) == str(store / e["blob"]), e["path"]
    finally:
        build.close()
    f = next(e for e in idx["files"] if e["path"] == "weights/expert-077.safetensors")
    p = store / f["blob"]
    p.write_bytes(_flip(p.read_bytes()))
    bad = cli("verify", str(store), "--golden", str(golden), "-q", env=private(tmp_path / "bad"))
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 1 and len(lines) == 1, bad.stderr
    assert f"{f['blob']} (weights/expert-077.safetensors): refused: sha256" in lines[0], lines


def test_a_stores_stacked_shards_are_held_a_layer_at_a_time(topo, tmp_path):
    """Opened in place, every expert and attention shard (stacked on the layer axis) is held
    without its layers' large ranges; a layer's turn fetches just them and its end returns them."""
    from gkbuild.publish.shards import open_build

    store = tmp_path / "store"
    publish(topo, str(store), quiet=True)
    build = open_build(str(store))
    try:
        for r in range(build.world_size):
            build.load_rank(r)
        layered = build._opener.layered
        shards = {f["path"] for f in build.manifest["files"] if f["path"].startswith(("weights/expert-", "weights/attn-"))}
        assert set(layered) == shards

        def resident() -> int:
            return sum(os.fstat(f.fd).st_blocks * 512 for f in layered.values())

        held = resident()
        size = sum(f["size"] for f in build.manifest["files"] if f["path"] in shards)
        share = sum(hi - lo for f in layered.values() for lo, hi in f.spans[1])
        assert held <= size - 2 * share + len(shards) * 8192  # neither layer's large ranges
        build.need_layer(1)
        assert share <= resident() - held <= share + len(shards) * 2 * 8192
        build.done_layer(1)
        edges = sum(len(f.spans[1]) for f in layered.values()) * 2 * 4096  # a range's partial pages stay
        assert held <= resident() <= held + edges
    finally:
        build.close()
