"""A compile cache shared between build hosts (``gkbuild compile --cache STORE``).

Compiles are the slow step (minutes to an hour for a NEFF, ~40 s for the tiny ``.pt2`` programs)
and every build host would repeat them. Before compiling a program, the compile stage looks its
key up in a store (a folder, ``hf://ORG/NAME`` or ``s3://BUCKET/PREFIX``); on a hit the artifact
is fetched and verified instead; ``--cache-push`` stores what was compiled. The store holds

    compile/<key>.json           one entry a program: the key, what was compiled, and its blob
    blobs/<sha256>.<zst|raw>     the artifact behind a one-line header naming its key and program
                                 (the publish stores' naming, codec and bounds)

The blob's hashed content starts with ``gkbuild-compile-cache/2`` and the program's key, name,
size and sha256: an entry re-pointed at another program's blob (whose hash and size it copies)
is refused, because the key is inside what the blob's name hashes, not only beside it.

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
import json
import os
import zipfile
from pathlib import Path

from ..errors import GkError
from ..jsonio import open_regular
from ..paths import confined, create
from ..pipeline.state import key
from ..progress import warn
from ..publish import codec, index
from ..s3 import Conflict
from .cache_entries import FORMAT, KEY as _KEY, MAX_ENTRY, VERSION, entries, entry_name, make_entry, parse_entry

MAGIC = b"gkbuild-compile-cache/2 "
MAX_HEADER = 4096
ENV, ENV_PUSH = "GKBUILD_COMPILE_CACHE", "GKBUILD_COMPILE_CACHE_PUSH"
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


def header(k: str, program: str, size: int, sha256: str) -> bytes:
    """The line a blob starts with: what it is the program of."""
    return MAGIC + json.dumps({"key": k, "program": program, "size": size, "sha256": sha256},
                              sort_keys=True).encode() + b"\n"


def check_artifact(path: Path, fmt: str, program: str) -> None:
    """The artifact's own format, fully read: a NEFF (header, payload size and hash), or a .pt2
    that is an AOTInductor package of this program (torch's own test, torch==2.13.0:
    torch/export/pt2_archive/_package.py:74 ``is_pt2_package``; the archive's root is the
    program's name, as gkbuild compiles it; it holds ``data/aotinductor/``), every member's CRC
    right and every name inside the package. Any other zip is refused."""
    if fmt == "neff":
        from .neff import read

        read(path)
        return
    from torch.export.pt2_archive import is_pt2_package
    from torch.export.pt2_archive.constants import AOTINDUCTOR_DIR

    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            bad = next((n for n in names if n.startswith("/") or ".." in n.split("/") or "\\" in n), None)
            if bad is not None:
                raise GkError(f"{path}: the package names a member outside it ({bad!r}); refused")
            if not (is_pt2_package(str(path)) and all(n.split("/")[0] == program for n in names)
                    and any(n.startswith(f"{program}/{AOTINDUCTOR_DIR}") for n in names)):
                raise GkError(f"{path}: not a .pt2 package of the {program} program (an AOTInductor archive rooted "
                              f"at {program}/); refused")
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
            blob = f"{self.uri}/{a['blob']}"
            with self.store.open_blob(a["blob"]) as src, os.fdopen(create(tmp), "wb") as out:
                sink = _Unwrap(out, header(k, program, a["size"], a["sha256"]), blob)
                got = codec.decode(src, sink, a["encoding"], len(sink.want) + a["size"], a["stored_size"], blob)
            if got != a["blob_sha256"]:
                raise GkError(f"{blob}: sha256 {got[:16]} differs from the entry's {a['blob_sha256'][:16]}")
            if sink.sha.hexdigest() != a["sha256"]:
                raise GkError(f"{blob}: the artifact's sha256 differs from the entry's {a['sha256'][:16]}")
            check_artifact(tmp, a["format"], program)
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
        head = header(k, program, artifact["size"], artifact["sha256"])
        with open_regular(path, buffering=0) as f:
            blob_sha, h = hashlib.sha256(head), hashlib.sha256()
            while chunk := f.read(8 << 20):
                blob_sha.update(chunk)
                h.update(chunk)
        if h.hexdigest() != artifact["sha256"]:
            raise GkError(f"{path}: sha256 {h.hexdigest()[:16]} differs from the build's {artifact['sha256'][:16]} "
                          f"(changed since it was compiled); not pushed")
        name = index.blob_name(blob_sha.hexdigest(), enc)
        stored = self.store.stored()
        if name in stored:
            stored_size = stored[name]
        else:
            with self.store.writer(name) as out, open_regular(path, buffering=0) as src:
                got, stored_size = codec.encode(_Chain(head, src), out, enc)
            if got != blob_sha.hexdigest():
                raise GkError(f"{path}: changed while it was pushed; not pushed")
        try:
            entry = make_entry(k, program, artifact, enc, stored_size, blob_sha.hexdigest())
            self.store.put(entry_name(k), index.dumps(entry))
        except Conflict:
            return False  # another host pushed the same key meanwhile: same inputs, its program serves
        self.pushed.append(program)
        return True

    def summary(self) -> str:
        parts = [f"{len(self.hits)} from the compile cache"] if self.hits else []
        if self.pushed:
            parts.append(f"{len(self.pushed)} pushed")
        return f"{', '.join(parts)} ({self.uri})" if parts else ""


class _Chain:
    """``head`` then the file ``f``, as one reader (``readinto``, what ``codec.encode`` reads)."""

    def __init__(self, head: bytes, f):
        self.head, self.f = memoryview(head), f

    def readinto(self, buf) -> int:
        if self.head:
            n = min(len(buf), len(self.head))
            buf[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        return self.f.readinto(buf) or 0


class _Unwrap:
    """A sink for a cache blob: its first bytes must be exactly ``want`` (the header of the key and
    program asked for), the rest is the artifact, written to ``out`` and hashed."""

    def __init__(self, out, want: bytes, where: str):
        self.out, self.want, self.where = out, want, where
        self.seen = bytearray()
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        n = len(data)
        if len(self.seen) < len(self.want):
            take = min(n, len(self.want) - len(self.seen))
            self.seen += data[:take]
            if self.want[:len(self.seen)] != bytes(self.seen):
                line = bytes(self.seen).split(b"\n")[0][:MAX_HEADER]
                said = "not a compile-cache blob" if not line.startswith(MAGIC) else \
                    f"the blob of {line[len(MAGIC):].decode('utf-8', 'replace')[:120]}"
                raise GkError(f"{self.where}: {said}, not of the key and program this entry is for; refused")
            data = data[take:]
        self.sha.update(data)
        self.out.write(data)
        return n


def prune(store, keep: set[str] | None = None) -> dict:
    """Drop entries whose blob is gone or is not one the entry could name, entries whose key is
    not in ``keep`` (when given), then blobs no remaining entry names, nor the store's publish
    index (a cache may share a store with builds), unless a publish is in progress there (its
    lease). Only names a push writes are ever deleted."""
    from ..publish.leases import blocked, others_alive

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
    raw = store.read_index()
    published = index.blobs(index.parse(raw, f"{store.uri}/{index.NAME}")) if raw is not None else set()
    others = others_alive(store)
    if others:
        warn(blocked(store, others, "blobs"))
    dead = [] if others else sorted(n for n in blobs if n not in live | published)
    store.delete(drop + dead)
    return {"entries_removed": len(drop), "blobs_removed": len(dead), "entries_kept": kept,
            "bytes_freed": sum(blobs[n] for n in dead)}


def build_keys(build_dir: Path) -> set[str]:
    """The compile keys of a build's programs (from its manifest)."""
    from ..pipeline import manifest as mf

    keys = set(mf.load(build_dir)["compile"].get("cache_keys", {}).values())
    if not keys:  # keeping "only its programs" would then drop every entry
        raise GkError(f"{build_dir}: has no compiled programs (no compile keys); refusing to prune by it")
    return keys


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

