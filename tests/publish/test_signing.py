"""Signed builds (model-signing): a build published with --sign KEY fetches with --trust KEY.pub and
opens with Build.open(trust=...), from a folder, a hub and an S3 store; every refusal is one line
naming the build and the reason, with nothing moved into place; keyless Sigstore is exercised up to
the network boundary (no test reaches beyond this machine)."""

from __future__ import annotations

import json
import re
import shutil
import socket

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gkbuild import recipe
from gkbuild.errors import GkError
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.publish import index, signing
from gkbuild.publish.fetch import fetch
from gkbuild.publish.publish import publish
from gkbuild.runtime import Build
from tests.conftest import RECIPES, run_cli
from tests.publish.conftest import put_blob, read_store, rewrite, unzstd
from tests.publish.fake_hub import FakeHub


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    """Three P-256 key pairs: name -> (private PEM path, public PEM path)."""
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("ci", "old", "mallory"):
        k = ec.generate_private_key(ec.SECP256R1())
        (d / f"{name}.pem").write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
        (d / f"{name}.pub").write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
        out[name] = (str(d / f"{name}.pem"), str(d / f"{name}.pub"))
    return out


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No connection leaves this machine: name lookups and connects to anything but loopback fail
    at once (Sigstore's TUF client and OIDC discovery then fail as they would offline); sigstore's
    caches live in the test's folder."""
    real_lookup, real_connect = socket.getaddrinfo, socket.socket.connect
    tried = []

    def lookup(host, *a, **k):
        if host not in ("127.0.0.1", "localhost", "::1"):
            tried.append(host)
            raise socket.gaierror(socket.EAI_NONAME, f"network blocked in tests: {host}")
        return real_lookup(host, *a, **k)

    def connect(self, addr):
        if isinstance(addr, tuple) and addr[0] not in ("127.0.0.1", "::1"):
            tried.append(addr[0])
            raise OSError(f"network blocked in tests: {addr[0]}")
        return real_connect(self, addr)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    return tried


def _refused(match: str, fn, *a, **k) -> str:
    with pytest.raises(GkError, match=match) as e:
        fn(*a, **k)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_build_signed_with_a_key_fetches_with_its_public_key_and_loads_with_trust(build, keys, tmp_path):
    store = tmp_path / "store"
    publish(build, str(store), quiet=True, sign=keys["ci"][0])
    idx = json.loads((store / index.NAME).read_text())
    assert {"signature", "provenance"} <= idx.keys() and {idx[k]["blob"] for k in index.SIGNED} <= index.blobs(idx)
    got = fetch(str(store), tmp_path / "got", quiet=True, trust=signing.trust_list([keys["ci"][1]]))
    assert got["signed_by"] == f"key {keys['ci'][1]}" and problems(tmp_path / "got") == []
    b = Build.open(tmp_path / "got", trust=[keys["old"][1], keys["ci"][1]])  # two keys: rotation
    assert b.load_rank(0) and b.layout_doc("kv")
    # the provenance: recipe and its sha256, source and revision, gkbuild version, compilers, CI run
    prov = json.loads((tmp_path / "got" / "provenance.json").read_text())
    m = mf.load(build)
    ext = prov["predicate"]["buildDefinition"]["externalParameters"]
    assert ext["recipe_sha256"] == m["recipe"]["digest"] and ext["recipe"] == m["recipe"]["resolved"]
    deps = prov["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert deps[0]["uri"] == m["source"]["uri"] and {d["name"] for d in deps[1:] if "digest" in d} >= \
        {f["name"] for f in m["source"]["files"]}
    assert prov["predicate"]["buildDefinition"]["internalParameters"]["tools"]["gkbuild"] == m["tools"]["gkbuild"]
    assert {d["name"] for d in deps if d["name"].startswith("program:")} == \
        {f"program:{a['name']}" for a in m["compile"]["artifacts"]}
    assert prov["subject"][0]["digest"]["sha256"] == signing.hashlib.sha256(mf.read_bytes(build)).hexdigest()


def test_the_provenance_names_the_ci_run(build, monkeypatch):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/gk")
    monkeypatch.setenv("GITHUB_RUN_ID", "42")
    monkeypatch.setenv("GITHUB_WORKFLOW_REF", "org/gk/.github/workflows/build-artifacts.yml@refs/tags/build-1")
    prov = signing.provenance(mf.load(build), mf.read_bytes(build))
    run = prov["predicate"]["runDetails"]
    assert run["builder"]["id"] == "https://github.com/org/gk/actions/runs/42/attempts/1"
    assert run["metadata"]["ci"]["workflow"].endswith("build-artifacts.yml@refs/tags/build-1")


def _signed_store(build, keys, tmp_path, name="store"):
    store = tmp_path / name
    publish(build, str(store), quiet=True, sign=keys["ci"][0])
    return store


def _fetch_refused(store, keys, tmp_path, match):
    dest = tmp_path / "dest"
    msg = _refused(match, fetch, str(store), dest, quiet=True, trust=signing.trust_list([keys["ci"][1]]))
    assert not dest.exists()  # refused before anything was written
    return msg


def test_an_unsigned_build_is_refused(build, keys, tmp_path):
    publish(build, str(tmp_path / "store"), quiet=True)
    msg = _fetch_refused(tmp_path / "store", keys, tmp_path, "not signed")
    assert "tiny-cpu" in msg and mf.load(build)["build_id"][:16] in msg
    _refused(r"not signed", Build.open, build, trust=[keys["ci"][1]])


def test_a_tampered_manifest_is_refused(build, keys, tmp_path):
    store = _signed_store(build, keys, tmp_path)
    idx, m = read_store(store)
    m["name"] = "evil"  # a self-consistent manifest: the build id recomputed, as a forger would
    rewrite(store, idx, m)
    _fetch_refused(store, keys, tmp_path, "signature is over another manifest")
    (build / mf.NAME).write_bytes(mf.canonical(m))  # and in a folder
    _refused("signature is over another manifest", Build.open, build, trust=[keys["ci"][1]])


def _forge(build, keys) -> None:
    """Change a file of the build, make its manifest say so, and sign that with another key."""
    tail = build / "layout" / "tail.json"
    doc = json.loads(tail.read_text())
    doc["k"] = 1
    tail.write_text(json.dumps(doc))
    m = mf.load(build)
    f = next(f for f in m["files"] if f["path"] == "layout/tail.json")
    f["size"], f["sha256"] = tail.stat().st_size, signing.hashlib.sha256(tail.read_bytes()).hexdigest()
    m["build_id"] = mf.build_id(m)
    mf.write(build / mf.NAME, m)


def test_a_tampered_file_with_a_manifest_resigned_by_another_key_is_refused(build, keys, tmp_path):
    _forge(build, keys)
    publish(build, str(tmp_path / "store"), quiet=True, sign=keys["mallory"][0])
    msg = _fetch_refused(tmp_path / "store", keys, tmp_path, "not trusted .*signed by another key")
    assert keys["ci"][1] in msg
    _refused("not trusted", Build.open, build, trust=[keys["ci"][1], keys["old"][1]])


def test_a_signature_moved_from_another_build_is_refused(built, build, keys, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(built, other)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=other, quiet=True, compile=False)
    store = _signed_store(other, keys, tmp_path, "other-store")  # a genuine signature, of another build
    theirs = json.loads((store / index.NAME).read_text())
    mine = _signed_store(build, keys, tmp_path)
    idx = json.loads((mine / index.NAME).read_text())
    for k in index.SIGNED:
        idx[k] = put_blob(mine, (store / theirs[k]["blob"]).read_bytes() if theirs[k]["encoding"] == "raw"
                          else signing_bytes(store, theirs[k]), "raw")
    (mine / index.NAME).write_bytes(index.dumps(idx))
    _fetch_refused(mine, keys, tmp_path, "signature is over another manifest")
    for name in ("manifest.sig", "provenance.json"):  # in a folder: the other build's files beside this manifest
        shutil.copy(other / name, build / name)
    _refused("signature is over another manifest", Build.open, build, trust=[keys["ci"][1]])


def signing_bytes(store, e) -> bytes:
    return unzstd((store / e["blob"]).read_bytes())


def test_a_corrupt_or_hostile_signature_is_one_line(build, keys, tmp_path):
    store = _signed_store(build, keys, tmp_path)
    sig = json.loads((build / "manifest.sig").read_text())
    env = sig["dsseEnvelope"]["signatures"][0]
    env["sig"] = ("A" if env["sig"][0] != "A" else "B") + env["sig"][1:]
    (build / "manifest.sig").write_text(json.dumps(sig))
    _refused("does not verify", Build.open, build, trust=[keys["ci"][1]])
    (build / "manifest.sig").write_text("[" * 100000 + "]" * 100000)
    _refused("nested deeper", Build.open, build, trust=[keys["ci"][1]])
    (build / "manifest.sig").write_text('{"mediaType": 1}')
    _refused("not trusted", Build.open, build, trust=[keys["ci"][1]])
    idx = json.loads((store / index.NAME).read_text())
    del idx["provenance"]
    (store / index.NAME).write_bytes(index.dumps(idx))
    _fetch_refused(store, keys, tmp_path, "a signature without its provenance")


def test_signed_builds_through_the_hub_and_s3(build, keys, bucket, tmp_path):
    hub = FakeHub()
    publish(build, "hf://org/gk", api=hub, fs=hub, quiet=True, sign=keys["ci"][0])
    fetch("hf://org/gk", tmp_path / "a", api=hub, fs=hub, quiet=True, trust=signing.trust_list([keys["ci"][1]]))
    Build.open(tmp_path / "a", trust=[keys["ci"][1]])
    uri = f"s3://{bucket}/signed"
    publish(tmp_path / "a", uri, quiet=True)  # a fetched signed build republished carries its signature
    fetch(uri, tmp_path / "b", quiet=True, trust=signing.trust_list([keys["ci"][1]]))
    assert problems(tmp_path / "b") == [] and Build.open(tmp_path / "b", trust=[keys["ci"][1]])
    with pytest.raises(GkError, match="not trusted"):
        fetch(uri, tmp_path / "c", quiet=True, trust=signing.trust_list([keys["mallory"][1]]))
    assert not (tmp_path / "c").exists()


def test_verify_signature_checks_without_fetching(build, keys, tmp_path):
    store = _signed_store(build, keys, tmp_path)
    ok = run_cli("verify-signature", str(store), "--trust", keys["old"][1], "--trust", keys["ci"][1])
    assert ok.returncode == 0 and "signed by key" in ok.stderr + ok.stdout and "tiny-cpu" in ok.stderr + ok.stdout
    ok = run_cli("verify-signature", str(build), "--trust", keys["ci"][1], "--json")
    assert json.loads(ok.stdout)["recipe_sha256"] == mf.load(build)["recipe"]["digest"]
    bad = run_cli("verify-signature", str(store), "--trust", keys["mallory"][1])
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "not trusted" in bad.stderr
    bad = run_cli("verify-signature", str(store), "--trust", "nothing-of-the-kind")
    assert bad.returncode == 1 and "neither a public key file nor a signer identity" in bad.stderr
    assert not (tmp_path / "dest").exists()


def _sign_provenance(build, keys, edit) -> None:
    """Sign (with the trusted key) this build's manifest and its provenance changed by ``edit``."""
    man = mf.read_bytes(build)
    prov = signing.provenance(mf.load(build), man)
    edit(prov)
    prov_bytes = signing.dumps(prov)
    signing.write_folder(build, (signing.sign(man, prov_bytes, keys["ci"][0]), prov_bytes))


@pytest.mark.parametrize("edit, field, cli", [  # the CLI for the two shapes the probe saw
    (lambda p: p.update(predicate=[1, 2]), "predicate is not an object", True),
    (lambda p: p["predicate"].update(buildDefinition="x"), "predicate.buildDefinition is not an object", True),
    (lambda p: p["predicate"]["runDetails"]["builder"].pop("id"), "predicate.runDetails.builder.id is not a string",
     False),
    (lambda p: p["predicate"]["buildDefinition"]["resolvedDependencies"][0].update(uri=["s3://x"]),
     "resolvedDependencies.[].uri is not a string", False),
])
def test_a_validly_signed_provenance_of_the_wrong_shape_is_refused_in_one_line(build, keys, edit, field, cli):
    _sign_provenance(build, keys, edit)
    _refused(f"the signed provenance field .*{re.escape(field)}", Build.open, build, trust=[keys["ci"][1]])
    for extra in ((), ("--json",)) if cli else ():
        bad = run_cli("verify-signature", str(build), "--trust", keys["ci"][1], *extra)
        assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and not bad.stdout, bad.stderr
        assert "refused: the signed provenance field" in bad.stderr and field in bad.stderr, bad.stderr


def test_a_rebuild_takes_the_old_signature_away(build, keys, tmp_path):
    _signed_store(build, keys, tmp_path)
    assert (build / "manifest.sig").exists()
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=build, quiet=True, compile=False)
    assert not (build / "manifest.sig").exists() and not (build / "provenance.json").exists()
    assert problems(build) == []


# -- keyless Sigstore, up to the network boundary --------------------------------------------------
def test_keyless_signing_asks_for_the_ambient_oidc_identity_and_fails_cleanly_offline(build, offline, monkeypatch,
                                                                                       tmp_path):
    from model_signing import signing as ms_signing

    asked = []
    real = ms_signing.Config.use_sigstore_signer

    def spy(self, **kw):
        asked.append(kw)
        return real(self, **kw)

    monkeypatch.setattr(ms_signing.Config, "use_sigstore_signer", spy)
    msg = _refused(r"--sign 'sigstore': TUFError: .*keyless signing needs Sigstore .*id-token: write",
                   publish, build, str(tmp_path / "store"), quiet=True, sign="sigstore")
    assert asked == [{"use_ambient_credentials": True}] and offline  # it tried Sigstore, and was stopped here
    assert not (tmp_path / "store").exists() and not (build / "manifest.sig").exists()
    assert len(msg) < 400


def test_keyless_trust_checks_the_workflow_identity_and_fails_cleanly_offline(build, keys, offline, monkeypatch,
                                                                              tmp_path):
    from model_signing import verifying

    store = _signed_store(build, keys, tmp_path)
    asked = []
    real = verifying.Config.use_sigstore_verifier

    def spy(self, **kw):
        asked.append(kw)
        return real(self, **kw)

    monkeypatch.setattr(verifying.Config, "use_sigstore_verifier", spy)
    who = "https://github.com/org/gk/.github/workflows/build-artifacts.yml@refs/tags/build-1"
    _refused(r"cannot check identity .*build-artifacts.yml.* TUFError", fetch, str(store), tmp_path / "d",
             quiet=True, trust=signing.trust_list([who]))
    assert asked == [{"identity": who, "oidc_issuer": signing.GITHUB_ISSUER}] and offline
    assert not (tmp_path / "d").exists()
    # a key entry beside the identity is tried first: a key-signed build needs no network
    assert fetch(str(store), tmp_path / "d", quiet=True, trust=signing.trust_list([keys["ci"][1], who]))


# -- issue 27 item 10: what a signature vouches for --------------------------------------------------
def _flip_a_byte(path) -> None:
    """An edit in place at the same size (what a size check cannot see)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _cli(capsys, *args) -> tuple[int, str, str]:
    """gkbuild in this process (no interpreter start): (exit code, stdout, stderr on one line)."""
    from gkbuild import cli

    capsys.readouterr()
    try:
        cli.main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    got = capsys.readouterr()
    return code, got.out, got.err


def test_verify_signature_checks_a_folders_files_against_the_signed_manifest(build, keys, tmp_path, capsys):
    store = _signed_store(build, keys, tmp_path)
    code, _, err = _cli(capsys, "verify-signature", str(build), "--trust", keys["ci"][1])
    assert code == 0 and f"its {len(mf.load(build)['files'])} files match the signed manifest" in " ".join(err.split())
    code, out, _ = _cli(capsys, "verify-signature", str(store), "--trust", keys["ci"][1], "--json")
    assert code == 0 and json.loads(out)["files_checked"] is None  # a store: nothing fetched
    code, _, err = _cli(capsys, "verify-signature", str(store), "--trust", keys["ci"][1])
    assert "gkbuild fetch checks each" in " ".join(err.split())
    shard = build / "weights" / "attn-tp0.safetensors"
    _flip_a_byte(shard)
    code, _, err = _cli(capsys, "verify-signature", str(build), "--trust", keys["ci"][1])
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert "the signature is good, but a file is not what it signed" in err and str(shard) in err


def test_under_trust_each_verify_mode_guarantees_what_its_docstring_says(build, keys, tmp_path):
    _signed_store(build, keys, tmp_path)
    _flip_a_byte(build / "weights" / "attn-tp0.safetensors")
    with pytest.raises(GkError, match="attn-tp0.safetensors: refused: sha256"):
        Build.open(build, trust=[keys["ci"][1]]).load_rank(0)  # "hash": only the signed bytes load
    with pytest.raises(GkError, match="attn-tp0.safetensors: refused: sha256"):
        Build.open(build, trust=[keys["ci"][1]]).verify_files()
    b = Build.open(build, trust=[keys["ci"][1]], verify="size")  # "size": the signed sizes only, as documented
    assert b.signature.by.key is not None and b.load_rank(0)
    (build / "weights" / "attn-tp0.safetensors").write_bytes(b"short")
    with pytest.raises(GkError, match="5 bytes, the manifest says"):
        Build.open(build, trust=[keys["ci"][1]], verify="size").load_rank(0)
    assert "size" in Build.open.__doc__ and "edited at the same size loads" in " ".join(Build.open.__doc__.split())


def test_a_signature_carried_in_from_another_build_is_not_republished(built, build, keys, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(built, other)
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", ["tail.k=64"]), out=other, quiet=True, compile=False)
    _signed_store(other, keys, tmp_path, "other-store")  # a genuine signature, of another build
    for name in ("manifest.sig", "provenance.json"):
        shutil.copy(other / name, build / name)
    capsys.readouterr()
    rep = publish(build, str(tmp_path / "store"), quiet=True)  # no --sign: the carried signature is checked
    err = " ".join(capsys.readouterr().err.split())
    assert "manifest.sig: the signature is over another manifest or provenance" in err and "unsigned" in err
    idx = json.loads((tmp_path / "store" / index.NAME).read_text())
    assert not set(index.SIGNED) & idx.keys() and rep["build_id"] == mf.load(build)["build_id"]
    assert (build / "manifest.sig").exists()  # not gkbuild's to delete
    _fetch_refused(tmp_path / "store", keys, tmp_path, "not signed")
    publish(build, str(tmp_path / "store2"), quiet=True, sign=keys["ci"][0])  # its own signature is republished
    assert signing.mismatch(mf.read_bytes(build), signing.read_folder(build)) is None
    (build / "provenance.json").write_text("{}")  # but not beside another provenance
    assert "over another manifest or provenance" in signing.mismatch(mf.read_bytes(build), signing.read_folder(build))


@pytest.mark.parametrize("kind", ["rsa", "ed25519", "secp256k1"])
def test_keys_model_signing_cannot_use_are_refused_in_one_line(build, tmp_path, kind):
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    k = {"rsa": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
         "ed25519": ed25519.Ed25519PrivateKey.generate,
         "secp256k1": lambda: ec.generate_private_key(ec.SECP256K1())}[kind]()
    pub, pem = tmp_path / "k.pub", tmp_path / "k.pem"
    pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo))
    pem.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    said = {"rsa": "an RSA key", "ed25519": "an Ed25519 key", "secp256k1": "an elliptic-curve key on secp256k1"}[kind]
    why = f"{said}; model-signing signs and verifies with elliptic-curve keys on P-256, P-384 or P-521 only"
    _refused(why, signing.trust_list, [str(pub)])
    _refused(why, Build.open, build, trust=[str(pub)])
    _refused(why, publish, build, str(tmp_path / "store"), quiet=True, sign=str(pem))
    assert not (tmp_path / "store").exists() and not (build / "manifest.sig").exists()
    r = run_cli("verify-signature", str(build), "--trust", str(pub))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and why in " ".join(r.stderr.split())
    assert "keyless" not in r.stderr.split(";")[0]
