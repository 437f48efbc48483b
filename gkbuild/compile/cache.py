"""A compile cache shared between build hosts (``gkbuild compile --cache STORE``).

Compiles are the slow step (minutes to an hour for a NEFF, ~40 s for the tiny ``.pt2`` programs)
and every build host would repeat them. Before compiling a program, the compile stage looks its
key up in a store (a folder, ``hf://ORG/NAME`` or ``s3://BUCKET/PREFIX``); on a hit the artifact
is fetched and verified instead; ``--cache-push`` stores what was compiled. The store holds

    compile/<key>.json           one entry a program: the key, what was compiled, and its blob
    blobs/<sha256>.<zst|raw>     the artifact (the publish stores' naming, codec and bounds)

The key (``program_key``) holds everything that changes one program: its name and batch, its
signature (every input's name, shape, dtype, kind and shard file; the outputs; the kernel's
scalars), the backend, target, compiler name and version and flags, the kernel revision (the
sha256 of gkbuild's sources that trace it and, for NEFFs, the nki-library source and revision,
entry points, trace-time switches and trace mode), the gkbuild version, and the constants the
programs bake in (the plan's scalars and replica meshes; the tail's options for the tail). Never weights
or the source checkpoint: weights are graph inputs, so new weights of the same shapes reuse a
program, and a tail option recompiles only the tail.

A fetched artifact is checked as strictly as a fetched build file before it is moved into the
build: the entry's key, program, format, target, compiler and flags against this compile's, its
size bounded before reading, its bytes decoded within the declared sizes and hashed against the
entry, then the format itself (a ``.pt2`` is a zip of native code: every member's CRC and name;
a NEFF: its header and payload hash). What fails is reported and compiled instead. Anyone who can
write to a cache can put code into builds that read it: give build hosts read-only credentials and
push only from CI.
"""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
from pathlib import Path

from ..errors import GkError
from ..paths import confined
from ..pipeline.state import key
from ..progress import warn
from ..publish import codec, index
from ..s3 import Conflict

FORMAT, VERSION = "gkbuild-compile-cache", 1
ENTRIES = "compile"
MAX_ENTRY = 1 << 20
MAX_ARTIFACT = 64 << 30  # a NEFF of the full model is a few GB
ENV, ENV_PUSH = "GKBUILD_COMPILE_CACHE", "GKBUILD_COMPILE_CACHE_PUSH"
_KEY = re.compile(r"^[0-9a-f]{64}$")
# gkbuild's own code a program is traced through: a change here is a new program even under the
# same gkbuild version.
KERNEL_SOURCES = {"inductor": ("kernels/*.py", "compile/programs.py", "compile/signature.py", "compile/inductor.py"),
                  "neuron": ("compile/neuron.py", "compile/neuron_trace.py", "compile/signature.py",
                             "compile/switches.py", "compile/interface.py", "compile/interfaces/*.json")}


def kernel_revision(backend: str, kernel: dict | None) -> str:
    """The revision of the code a program is made from: the sha256 of gkbuild's sources that trace
    it and, for NEFFs, the program's kernel (library source and revision, entry point, switch
    overrides, trace mode: with gkbuild's switch policy and interfaces, its whole switch setting)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pattern in KERNEL_SOURCES[backend]:
        for p in sorted(root.glob(pattern)):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return key(h.hexdigest(), kernel)


def program_key(plan, sig, compiler: dict, flags: list[str], kernel: dict | None) -> str:
    """What one program's bytes depend on: its signature (name, batch, inputs, outputs, kernel
    scalars), the compiler and its flags, the target, the kernel revision, the gkbuild version, the
    plan's scalars and replica meshes (constants the programs bake in) and, for the tail, the
    tail's options and hop meshes."""
    from .. import __version__

    r = plan.recipe
    return key(FORMAT, VERSION, sig.key, sig.program, sig.batch, r.backend, r.target, compiler, flags,
               [i.to_dict() for i in sig.inputs], list(sig.outputs), sig.scalars, plan.scalars, plan.meshes,
               plan.tail if sig.program == "tail" else None, kernel_revision(r.backend, kernel), __version__)


def entry_name(k: str) -> str:
    if not isinstance(k, str) or not _KEY.match(k):
        raise GkError(f"compile cache: {str(k)[:80]!r} is not a compile key (64 hex digits)")
    return f"{ENTRIES}/{k}.json"


def make_entry(k: str, program: str, artifact: dict, encoding: str, stored_size: int) -> dict:
    """``artifact``: format, target, compiler, flags, size, sha256 (as in the manifest)."""
    a = {f: artifact[f] for f in ("format", "target", "compiler", "flags", "size", "sha256")}
    a.update(encoding=encoding, stored_size=stored_size, blob=index.blob_name(a["sha256"], encoding))
    return {"format": FORMAT, "version": VERSION, "key": k, "program": program, "artifact": a}


def parse_entry(data: bytes, where: str, k: str | None = None) -> dict:
    """An entry, checked: format, version, key (the one asked for), sizes, hash and blob name."""
    e = index.load_versioned(data, where, FORMAT, VERSION, "compile-cache entry")
    a = e.get("artifact")
    ok = (isinstance(e.get("key"), str) and _KEY.match(e["key"]) and isinstance(e.get("program"), str)
          and isinstance(a, dict) and isinstance(a.get("sha256"), str) and _KEY.match(a["sha256"])
          and a.get("encoding") in codec.EXT and isinstance(a.get("flags"), list) and isinstance(a.get("compiler"), dict)
          and all(isinstance(a.get(f), int) and 0 <= a[f] <= MAX_ARTIFACT for f in ("size", "stored_size")))
    if not ok:
        raise GkError(f"{where}: malformed compile-cache entry")
    if a.get("blob") != index.blob_name(a["sha256"], a["encoding"]):
        raise GkError(f"{where}: names blob {a.get('blob')!r}, expected {index.blob_name(a['sha256'], a['encoding'])}")
    if k is not None and e["key"] != k:
        raise GkError(f"{where}: is the entry of key {e['key'][:16]}, not {k[:16]}")
    return e


def check_artifact(path: Path, fmt: str) -> None:
    """The artifact's own format, fully read: a .pt2 zip (every member's CRC, names that stay
    inside the package) or a NEFF (header, payload size and hash)."""
    if fmt == "neff":
        from .neff import read

        read(path)
        return
    try:
        with zipfile.ZipFile(path) as z:
            bad = next((n for n in z.namelist() if n.startswith("/") or ".." in n.split("/") or "\\" in n), None)
            if bad is not None:
                raise GkError(f"{path}: the package names a member outside it ({bad!r}); refused")
            broken = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise GkError(f"{path}: not a .pt2 package ({e})") from None
    if broken is not None:
        raise GkError(f"{path}: member {broken} fails its CRC; refused")


class CompileCache:
    """The cache one compile stage reads (and, with ``push``, writes)."""

    def __init__(self, uri: str, push: bool = False, staging: Path | None = None, api=None, fs=None):
        from ..publish.stores import open_store

        self.uri, self.push_enabled = uri, push
        self.store = open_store(uri, staging=staging, api=api, fs=fs)
        self.hits: list[str] = []
        self.pushed: list[str] = []
        self._prepared = False
        self._blobs: dict[str, int] | None = None  # the store's blobs and sizes, listed once (``holds``)

    def entry(self, k: str, program: str, expect: dict) -> dict | None:
        """The entry of key ``k`` (None when the cache has none), checked: its key, program, and the
        format, target, compiler and flags ``expect`` says this compile would use."""
        where = f"{self.uri}/{entry_name(k)}"
        raw = self.store.get(entry_name(k), MAX_ENTRY)
        if raw is None:
            return None
        e = parse_entry(raw, where, k)
        a = e["artifact"]
        if e["program"] != program:
            raise GkError(f"{where}: the entry is for the {e['program']} program, not {program}")
        for f in ("format", "target", "compiler", "flags"):
            if a.get(f) != expect[f]:
                raise GkError(f"{where}: the entry's {f} is {a.get(f)!r}, this compile's is {expect[f]!r}")
        return e

    def holds(self, k: str, program: str, expect: dict) -> bool:
        """Whether the cache holds the program of key ``k``, verified without fetching it: its entry
        (as ``restore`` checks it) and its blob, present at the entry's stored size. The bytes
        themselves are verified by the compile that restores them (which compiles instead if they
        do not)."""
        try:
            e = self.entry(k, program, expect)
        except GkError as err:
            warn(f"compile cache: {err}; {program} will be compiled")
            return False
        if e is None:
            return False
        if self._blobs is None:
            self._blobs = self.store.stored()
        a = e["artifact"]
        return self._blobs.get(a["blob"]) == a["stored_size"]

    def restore(self, k: str, program: str, dst: Path, expect: dict) -> bool:
        """Fetch the program of key ``k`` into ``dst`` if the cache has it and it verifies; else False.
        ``expect``: the format, target, compiler and flags this compile would use."""
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.cache.partial")
        try:
            e = self.entry(k, program, expect)
            if e is None:
                return False
            a = e["artifact"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            with self.store.open_blob(a["blob"]) as src, open(tmp, "wb") as out:
                got = codec.decode(src, out, a["encoding"], a["size"], a["stored_size"], f"{self.uri}/{a['blob']}")
            if got != a["sha256"]:
                raise GkError(f"{self.uri}/{a['blob']}: sha256 {got[:16]} differs from the entry's {a['sha256'][:16]}")
            check_artifact(tmp, a["format"])
            os.replace(tmp, dst)
        except GkError as err:
            warn(f"compile cache: {err}; compiling {program} instead")
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self.hits.append(program)
        return True

    def push(self, k: str, program: str, path: Path, artifact: dict) -> bool:
        """Store a compiled program under ``k`` (blob first, entry last, created only if absent);
        False when the cache already has the key. ``artifact`` as in the manifest."""
        if self.store.get(entry_name(k), MAX_ENTRY) is not None:
            return False
        if not self._prepared:
            self.store.prepare()
            self._prepared = True
        enc, _ = codec.choose(path)
        name = index.blob_name(artifact["sha256"], enc)
        stored = self.store.stored()
        if name in stored:
            stored_size = stored[name]
        else:
            with self.store.writer(name) as out, open(path, "rb", buffering=0) as src:
                got, stored_size = codec.encode(src, out, enc)
                if got != artifact["sha256"]:
                    raise GkError(f"{path}: sha256 {got[:16]} differs from the build's {artifact['sha256'][:16]} "
                                  f"(changed since it was compiled); not pushed")
        try:
            self.store.put(entry_name(k), index.dumps(make_entry(k, program, artifact, enc, stored_size)))
        except Conflict:
            return False  # another host pushed the same key meanwhile: same inputs, its program serves
        self.pushed.append(program)
        return True

    def summary(self) -> str:
        parts = [f"{len(self.hits)} from the compile cache"] if self.hits else []
        if self.pushed:
            parts.append(f"{len(self.pushed)} pushed")
        return f"{', '.join(parts)} ({self.uri})" if parts else ""


def entries(store) -> list[dict]:
    """Every entry in a cache store (malformed ones reported as such, not trusted)."""
    out = []
    for name in sorted(store.list(ENTRIES)):
        k = name[len(ENTRIES) + 1:].removesuffix(".json")
        try:
            raw = store.get(name, MAX_ENTRY)
            out.append(parse_entry(raw or b"", f"{store.uri}/{name}", k))
        except GkError as e:
            out.append({"key": k, "error": str(e)})
    return out


def prune(store, keep: set[str] | None = None) -> dict:
    """Drop entries whose blob is gone or is not one the entry could name, entries whose key is
    not in ``keep`` (when given), then blobs no remaining entry names. Only names a push writes
    are ever deleted."""
    blobs = {n: size for n, size in store.stored().items() if index.is_blob(n)}
    drop, live, kept = [], set(), 0
    for e in entries(store):
        a = e.get("artifact")
        if "error" in e or a["blob"] not in blobs or (keep is not None and e["key"] not in keep):
            if _KEY.match(e["key"]):
                drop.append(entry_name(e["key"]))
        else:
            live.add(a["blob"])
            kept += 1
    dead = sorted(n for n in blobs if n not in live)
    store.delete(drop + dead)
    return {"entries_removed": len(drop), "blobs_removed": len(dead), "entries_kept": kept,
            "bytes_freed": sum(blobs[n] for n in dead)}


def build_keys(build_dir: Path) -> set[str]:
    """The compile keys of a build's programs (from its manifest)."""
    from ..pipeline import manifest as mf

    return set(mf.load(build_dir)["compile"].get("cache_keys", {}).values())


def push_build(cache: CompileCache, build_dir: Path) -> int:
    """Push every compiled program of a build (``gkbuild cache push``); how many it has."""
    from ..pipeline import manifest as mf

    m = mf.load(build_dir)
    keys = m["compile"].get("cache_keys", {})
    arts = [a for a in m["compile"]["artifacts"] if a.get("path") and a["status"] == "ok" and a["name"] in keys]
    if not arts:
        raise GkError(f"{build_dir}: no compiled programs to push ({m['compile']['status']})")
    for a in arts:
        confined(a["path"], f"{build_dir} manifest")
        cache.push(keys[a["name"]], a["name"], Path(build_dir) / a["path"], a)
    return len(arts)

