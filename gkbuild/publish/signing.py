"""Signed builds: who built a build, from what, with which tools; and a host that refuses one not
signed by a key or identity it trusts.

What is signed, with OpenSSF model-signing (``gkbuild[sign]``): a folder of two files,
``manifest.json`` and ``provenance.json``. model-signing's in-toto statement (a DSSE envelope in a
Sigstore bundle) lists each file's sha256, so the signature covers the manifest (and through its
hashes every file of the build) and the provenance: an in-toto statement with a SLSA provenance v1
predicate whose subject is the manifest's sha256 and which records the recipe and its sha256, the
source checkpoint (URI, revision, files), gkbuild's version and tools, the compilers, flags and
kernel sources of every program, and the CI run when there is one.

Both travel beside the manifest: in a store as blobs the publish index names (``signature``,
``provenance``), in a build folder as ``manifest.sig`` and ``provenance.json``.

Trust is a list: public keys (PEM files; several, for rotation) and keyless identities (the
certificate identity Sigstore issued from an OIDC token, e.g. a CI workflow's, with its issuer).
Any one of them verifying is enough. Refused, in one line naming the build and the reason:
unsigned; a signature that does not verify (tampered or corrupt); signed by a key or identity not
trusted; a signature over another manifest (moved from another build, or the manifest edited).

The model-signing API used (model-signing==1.1.1): ``signing.Config().set_hashing_config(...)
.use_elliptic_key_signer(private_key=...) | .use_sigstore_signer(use_ambient_credentials=...)
.sign(model_path, signature_path)`` (signing.py:96,112,124,190), ``verifying.Config()
.set_hashing_config(...).use_elliptic_key_verifier(public_key=...) | .use_sigstore_verifier(
identity=..., oidc_issuer=...).verify(model_path, signature_path)`` (verifying.py:79,164,213,251),
``hashing.Config().use_file_serialization(hashing_algorithm=, allow_symlinks=)`` (hashing.py:278).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import __version__, jsonio
from ..errors import GkError, shown
from ..paths import PROVENANCE, SIGNATURE

MAX_SIGNATURE = 1 << 20  # a bundle is a few KB (a keyless one carries a certificate and a log entry)
MAX_PROVENANCE = 16 << 20
# GitHub Actions' OIDC issuer: the default for a keyless identity (the CI signs with it).
GITHUB_ISSUER = "https://token.actions.githubusercontent.com"
SIGSTORE = "sigstore"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:gkbuild:build:v1"


@dataclass(frozen=True)
class Trusted:
    """One trust entry: a public key file, or a keyless identity issued by ``issuer``."""

    key: Path | None = None
    identity: str | None = None
    issuer: str = GITHUB_ISSUER

    def __str__(self) -> str:
        return f"key {self.key}" if self.key else f"identity {self.identity} ({self.issuer})"


def trust_list(values, issuer: str | None = None) -> list[Trusted]:
    """``--trust`` values: a public key's PEM file, or a keyless identity (an e-mail or a URI such
    as ``https://github.com/ORG/REPO/.github/workflows/W.yml@refs/tags/T``) issued by ``issuer``
    (default GitHub Actions')."""
    issuer = issuer or GITHUB_ISSUER
    out = []
    for v in values:
        if isinstance(v, Trusted):
            out.append(v)
        elif os.path.isfile(v):
            _load_public_key(Path(v))
            out.append(Trusted(key=Path(v)))
        elif isinstance(v, str) and ("@" in v or "://" in v):
            out.append(Trusted(identity=v, issuer=issuer))
        else:
            raise GkError(f"--trust {shown(str(v))}: neither a public key file nor a signer identity (an e-mail "
                          f"or a workflow URI)")
    if not out:
        raise GkError("no trusted key or identity given; nothing can be trusted")
    return out


def _load_public_key(p: Path):
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(jsonio.read_bounded(p, 1 << 16))
    except (ValueError, TypeError) as e:
        raise GkError(f"{p}: not a PEM public key ({str(e)[:80]})") from None
    _supported(key, f"--trust {p}")
    return key


# What model-signing 1.1.1 signs and verifies with a key: elliptic-curve keys on these curves only
# (model-signing 1.1.1, model_signing/_signing/sign_ec_key.py:36-51, _check_supported_ec_key; its
# Signer and Verifier both call it, :97 and :159). RSA, Ed25519 and other curves it cannot use.
CURVES = ("secp256r1", "secp384r1", "secp521r1")


def _supported(key, where: str) -> None:
    """Refuse, in one line, a key model-signing cannot sign or verify with."""
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa

    pub = key.public_key() if hasattr(key, "public_key") else key
    if isinstance(pub, ec.EllipticCurvePublicKey):
        if pub.curve.name in CURVES:
            return
        kind = f"an elliptic-curve key on {pub.curve.name}"
    else:
        kinds = {rsa.RSAPublicKey: "an RSA key", ed25519.Ed25519PublicKey: "an Ed25519 key",
                 ed448.Ed448PublicKey: "an Ed448 key", dsa.DSAPublicKey: "a DSA key"}
        kind = next((k for t, k in kinds.items() if isinstance(pub, t)), f"a {type(pub).__name__}")
    raise GkError(f"{where}: {kind}; model-signing signs and verifies with elliptic-curve keys on P-256, P-384 or "
                  f"P-521 only (or keyless, with a Sigstore identity)")


def _model_signing():
    try:
        from model_signing import hashing, signing, verifying
    except ImportError as e:
        raise GkError(f"signing needs model-signing: pip install 'gkbuild[sign]' ({e})") from None
    return hashing, signing, verifying


def _hashing_config():
    hashing, _, _ = _model_signing()
    return hashing.Config().use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)


class _Subject:
    """The two signed files in a private folder, and the signature beside them."""

    def __init__(self, manifest: bytes, provenance: bytes, signature: bytes | None = None):
        self._tmp = tempfile.TemporaryDirectory(prefix="gkbuild-sign-")
        self.folder = Path(self._tmp.name) / "build"
        self.folder.mkdir()
        (self.folder / "manifest.json").write_bytes(manifest)
        (self.folder / PROVENANCE).write_bytes(provenance)
        self.signature = Path(self._tmp.name) / SIGNATURE
        if signature is not None:
            self.signature.write_bytes(signature)

    def __enter__(self) -> "_Subject":
        return self

    def __exit__(self, *exc) -> None:
        self._tmp.cleanup()


# -- provenance -------------------------------------------------------------------------------------
def ci_run() -> dict | None:
    """The CI run this process belongs to (GitHub Actions' environment), or None."""
    e = os.environ
    if e.get("GITHUB_ACTIONS") != "true" or not e.get("GITHUB_RUN_ID"):
        return None
    server, repo = e.get("GITHUB_SERVER_URL", "https://github.com"), e.get("GITHUB_REPOSITORY", "")
    return {"id": f"{server}/{repo}/actions/runs/{e['GITHUB_RUN_ID']}/attempts/{e.get('GITHUB_RUN_ATTEMPT', '1')}",
            "workflow": e.get("GITHUB_WORKFLOW_REF"), "commit": e.get("GITHUB_SHA"), "ref": e.get("GITHUB_REF")}


def provenance(m: dict, manifest: bytes) -> dict:
    """The provenance statement of a build (SLSA provenance v1 over the manifest's sha256)."""
    src = m["source"]
    deps = [{"name": "source", "uri": src.get("uri", ""), "annotations": {k: v for k, v in src.items() if k not in ("files", "uri")}}]
    deps += [{"name": f["name"], "digest": {"sha256": f["sha256"]}} for f in src.get("files", [])]
    for a in m["compile"]["artifacts"]:
        dep = {"name": f"program:{a['name']}", "annotations": {"compiler": a["compiler"], "flags": a["flags"],
                                                               "format": a["format"], "target": a["target"]}}
        if a.get("kernel"):
            dep["uri"] = a["kernel"]["library"]
            dep["annotations"]["kernel"] = a["kernel"]
        if a.get("sha256"):
            dep["digest"] = {"sha256": a["sha256"]}
        deps.append(dep)
    run = ci_run()
    return {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": m["name"], "digest": {"sha256": hashlib.sha256(manifest).hexdigest()}}],
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"recipe": m["recipe"]["resolved"], "recipe_sha256": m["recipe"]["digest"],
                                       "name": m["name"], "target": m["target"], "build_id": m["build_id"]},
                "internalParameters": {"tools": m["tools"], "compile_status": m["compile"]["status"]},
                "resolvedDependencies": deps,
            },
            "runDetails": {"builder": {"id": run["id"] if run else "gkbuild (no CI run)",
                                       "version": {"gkbuild": __version__}},
                           "metadata": {"ci": run} if run else {}},
        },
    }


# -- signing ----------------------------------------------------------------------------------------
def sign(manifest: bytes, prov: bytes, how: str) -> bytes:
    """A signature (Sigstore bundle) over the manifest and the provenance: with the private key in
    the PEM file ``how``, or keyless with ``how == "sigstore"`` (the OIDC identity of the CI
    runner: GitHub Actions with ``permissions: id-token: write``)."""
    _, signing, _ = _model_signing()
    config = signing.Config().set_hashing_config(_hashing_config())
    try:
        if how == SIGSTORE:
            config.use_sigstore_signer(use_ambient_credentials=True)
        else:
            if not os.path.isfile(how):
                raise GkError(f"--sign {shown(how)}: no such private key file (or give --sign sigstore for keyless)")
            _supported(_load_private_key(Path(how)), f"--sign {shown(how)}")
            config.use_elliptic_key_signer(private_key=Path(how))
        with _Subject(manifest, prov) as s:
            config.sign(s.folder, s.signature)
            return s.signature.read_bytes()
    except GkError:
        raise
    except Exception as e:  # noqa: BLE001 - model-signing, sigstore, cryptography: one line
        hint = ("keyless signing needs Sigstore (the network) and an OIDC identity: in CI, permissions: id-token: "
                "write" if how == SIGSTORE else "an unencrypted EC private key (P-256/384/521) in PEM")
        raise GkError(f"--sign {shown(how)}: {type(e).__name__}: {_first_line(e)}; {hint}") from None


def _load_private_key(p: Path):
    from cryptography.hazmat.primitives import serialization

    try:
        return serialization.load_pem_private_key(jsonio.read_bounded(p, 1 << 16), None)
    except (ValueError, TypeError) as e:
        raise GkError(f"--sign {p}: not an unencrypted PEM private key ({_first_line(e)[:80]})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else "(no message)"


# -- verification -----------------------------------------------------------------------------------
@dataclass
class Verified:
    by: Trusted
    provenance: dict


def verify(manifest: bytes, signed: tuple[bytes, bytes] | None, trust: list[Trusted], where: str) -> Verified:
    """Check that ``signed`` (signature, provenance) is a signature by one of ``trust`` over exactly
    ``manifest`` and its provenance; else one line naming ``where`` and the reason."""
    if signed is None:
        raise GkError(f"{where}: refused: the build is not signed (trusted: {', '.join(map(str, trust))})")
    sig, prov_bytes = signed
    try:
        jsonio.loads(sig, "signature", MAX_SIGNATURE)  # bounded and flat before the library parses it
        prov = jsonio.loads(prov_bytes, "provenance", MAX_PROVENANCE)
    except jsonio.BadJson as e:
        raise GkError(f"{where}: refused: the {e}") from None
    _, _, verifying = _model_signing()
    reasons = []
    with _Subject(manifest, prov_bytes, sig) as s:
        for t in trust:
            config = verifying.Config().set_hashing_config(_hashing_config())
            try:
                if t.key:
                    config.use_elliptic_key_verifier(public_key=t.key)
                else:
                    config.use_sigstore_verifier(identity=t.identity, oidc_issuer=t.issuer)
            except Exception as e:  # noqa: BLE001 - keyless: Sigstore's trust root comes over the network
                raise GkError(f"{where}: cannot check {t}: {type(e).__name__}: {_first_line(e)} (keyless verification "
                              f"needs Sigstore's trust root from the network; a public key needs nothing)") from None
            try:
                config.verify(s.folder, s.signature)
            except Exception as e:  # noqa: BLE001 - every way a signature fails is a refusal
                reasons.append((t, e))
                continue
            _check_provenance(prov, manifest, where)
            return Verified(t, prov)
    raise GkError(f"{where}: refused: {_why(reasons)}")


def mismatch(manifest: bytes, signed: tuple[bytes, bytes]) -> str | None:
    """Why ``signed`` (signature, provenance) is not a signature over exactly ``manifest`` and that
    provenance (None: it is). What the signed statement lists is checked, not who signed it: that
    takes a trusted key or identity (``verify``), which a publish does not have.

    model-signing 1.1.1's statement (model_signing/_signing/signing.py:169-252, ``Payload``; read
    back by ``dsse_payload_to_manifest``, :74-126): the Sigstore bundle's ``dsseEnvelope.payload`` is an in-toto
    statement (base64) whose ``predicate.resources`` list every signed file's ``name`` and sha256
    ``digest``."""
    import base64
    import binascii

    sig, prov_bytes = signed
    try:
        bundle = jsonio.loads(sig, "signature", MAX_SIGNATURE)
        prov = jsonio.loads(prov_bytes, "provenance", MAX_PROVENANCE)
        payload = bundle["dsseEnvelope"]["payload"] if isinstance(bundle, dict) and \
            isinstance(bundle.get("dsseEnvelope"), dict) else None
        statement = jsonio.loads(base64.b64decode(payload, validate=True), "signed statement", MAX_SIGNATURE) \
            if isinstance(payload, str) else None
    except (jsonio.BadJson, binascii.Error, ValueError) as e:
        return f"not a readable signature ({_first_line(e)[:120]})"
    resources = statement.get("predicate", {}).get("resources") if isinstance(statement, dict) and \
        isinstance(statement.get("predicate"), dict) else None
    if not isinstance(resources, list) or not all(isinstance(r, dict) for r in resources):
        return "not a model-signing signature (no list of signed files)"
    listed = {str(r.get("name")): r.get("digest") for r in resources}
    want = {"manifest.json": hashlib.sha256(manifest).hexdigest(), PROVENANCE: hashlib.sha256(prov_bytes).hexdigest()}
    if listed != want:
        return "the signature is over another manifest or provenance (moved from another build, or the manifest " \
               "changed since it was signed)"
    try:
        _check_provenance(prov, manifest, "")
    except GkError:
        return "the provenance beside it is not about this manifest"
    return None


def _why(reasons: list) -> str:
    """The most telling reason among the trust entries' failures."""
    text = [f"{type(e).__name__}: {_first_line(e)}" for _, e in reasons]
    if any("Signature mismatch" in x for x in text):
        return "the signature is over another manifest or provenance (moved from another build, or edited after signing)"
    if any("InvalidSignature" in x for x in text):
        return "the signature does not verify (tampered or corrupt)"
    said = ["signed by another key" if "Key mismatch" in x else x[:120] for x in text]
    return "signed by a key or identity that is not trusted (" + "; ".join(f"{t}: {s}" for (t, _), s in
                                                                        zip(reasons, said)) + ")"


# The provenance's fields gkbuild reads, with their JSON types ("[]": each item of a list; "?": may
# be absent). A trusted signature vouches for who wrote the document, not for its shape.
_PROVENANCE_FIELDS = (("predicateType", str), ("subject", list), ("subject.[]", dict), ("subject.[].digest", dict),
                      ("subject.[].digest.sha256", str), ("predicate", dict), ("predicate.buildDefinition", dict),
                      ("predicate.buildDefinition.externalParameters", dict),
                      ("predicate.buildDefinition.externalParameters.name", str),
                      ("predicate.buildDefinition.externalParameters.build_id", str),
                      ("predicate.buildDefinition.externalParameters.recipe_sha256", str),
                      ("predicate.buildDefinition.resolvedDependencies", list),
                      ("predicate.buildDefinition.resolvedDependencies.[]", dict),
                      ("predicate.buildDefinition.resolvedDependencies.[].uri?", str),
                      ("predicate.runDetails", dict), ("predicate.runDetails.builder", dict),
                      ("predicate.runDetails.builder.id", str))
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string"}


def _shape_problem(prov) -> str | None:
    """The first field of ``_PROVENANCE_FIELDS`` that is missing or of another type, or None."""
    if not isinstance(prov, dict):
        return "is not an object"
    for path, want in _PROVENANCE_FIELDS:
        *up, last = path.split(".")
        nodes = [prov]
        for key in up:  # parents come earlier in the table: checked already
            nodes = [x for n in nodes for x in (n if key == "[]" else [n[key]])]
        key = last.rstrip("?")
        for n in nodes:
            items = n if key == "[]" else [n[key]] if key in n else [] if last.endswith("?") else [None]
            if not all(isinstance(x, want) for x in items):
                return f"field {path.rstrip('?')} is not {_JSON_TYPES[want]}"
    return None if prov["subject"] else "has no subject"


def _check_provenance(prov, manifest: bytes, where: str) -> None:
    why = _shape_problem(prov)
    if why:
        raise GkError(f"{where}: refused: the signed provenance {why} (not an SLSA provenance as gkbuild writes it)")
    if prov["predicateType"] != SLSA_PROVENANCE or \
            prov["subject"][0]["digest"]["sha256"] != hashlib.sha256(manifest).hexdigest():
        raise GkError(f"{where}: refused: the signed provenance is not about this manifest")


# -- where the signed files live --------------------------------------------------------------------
def read_folder(root: Path) -> tuple[bytes, bytes] | None:
    """(signature, provenance) beside a build folder's manifest, or None when unsigned."""
    from ..paths import inside

    sig, prov = inside(root, SIGNATURE), inside(root, PROVENANCE)
    if not os.path.lexists(sig):
        return None
    try:
        return jsonio.read_bounded(sig, MAX_SIGNATURE), jsonio.read_bounded(prov, MAX_PROVENANCE)
    except FileNotFoundError:
        raise GkError(f"{root}: {SIGNATURE} without {PROVENANCE}; refused") from None


def write_folder(root: Path, signed: tuple[bytes, bytes] | None) -> None:
    """Put (or, with None, take away) the signature and provenance beside a build's manifest."""
    from ..paths import inside
    from ..pipeline.state import write_bytes_atomic

    for name, data in zip((SIGNATURE, PROVENANCE), signed or (None, None)):
        p = inside(root, name)
        if data is None:
            p.unlink(missing_ok=True)
        else:
            write_bytes_atomic(p, data)


def describe(v: Verified) -> dict:
    """What a verified provenance (its shape checked by ``_check_provenance``) says, for people
    (``verify-signature``)."""
    p = v.provenance["predicate"]
    ext = p["buildDefinition"]["externalParameters"]
    return {"signed_by": str(v.by), "name": ext["name"], "build_id": ext["build_id"],
            "recipe_sha256": ext["recipe_sha256"], "builder": p["runDetails"]["builder"]["id"],
            "source": next((d["uri"] for d in p["buildDefinition"]["resolvedDependencies"] if "uri" in d), None)}


def dumps(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
