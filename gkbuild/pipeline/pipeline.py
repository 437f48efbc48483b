"""``gkbuild compile``: the stages of DESIGN.md, each skipped when its key is unchanged.

    resolve -> validate -> plan -> shards -> layout -> compile -> manifest

Keys hash a stage's parameters, its inputs' fingerprints (source files by sha256, remembered by
path+size+mtime) and the gkbuild version. Shards are keyed one by one, so changing the vocab split
rebuilds only the tail shards; a tail option that changes no weight (k, emit_logits) rewrites only
the layout metadata and the manifest. Independent shards run in parallel worker processes; every
output is written under a temporary name and renamed when complete, and finished shards are
committed to the folder's state (after a filesystem sync) as the build goes, so an interrupted
build resumes without redoing them.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..checkpoint.names import LAYOUTS
from ..checkpoint.reader import INDEX, weight_files
from ..checkpoint.safetensors_io import fsync_dir, syncfs
from ..checkpoint.source import cache_root, materialize, parse, synth_by_range, synth_cache_dir, synth_config
from ..errors import GkError
from ..layout import LAYOUT_VERSION
from ..layout.tail import owned_rows
from ..model import GptOssConfig
from ..paths import claim, file_lock, inside, our_temporaries, resolved
from ..plan import Plan, ShardFile, make_plan
from ..progress import Progress
from ..recipe import QUANTIZER_VERSION, Recipe
from ..publish import signing
from . import manifest as mf
from .fingerprint import Fingerprints, sha256_file
from .state import STATE_DIR, State, dumps_strict, intact, key, stat_of, write_bytes_atomic

# Seconds between the syncs that commit finished shards to the state: what an interruption can
# cost at most (a shard written but not yet committed is rewritten on the next run).
SYNC_INTERVAL = float(os.environ.get("GKBUILD_SYNC_INTERVAL", "2.0"))


@dataclass
class StageReport:
    name: str
    status: str  # ran | cached | pending | skipped
    seconds: float = 0.0
    detail: str = ""


@dataclass
class BuildResult:
    out: Path
    stages: list[StageReport]
    manifest: dict
    shards_written: int = 0
    bytes_written: int = 0
    seconds: float = 0.0

    @property
    def did_work(self) -> bool:
        return any(s.status == "ran" for s in self.stages)

    def summary(self) -> dict:
        """What ``compile --json`` prints. ``source``: the checkpoint (its URI, the content hash a
        golden of it records, the KV format a golden for this build emulates): what CI keys and
        computes the golden of a build by."""
        m = self.manifest
        source = {"uri": m["source"]["uri"], "sha256": mf.checkpoint_hash(m["source"]["files"]),
                  "kv": mf.kv_meta(m)}
        return {"build": str(self.out), "build_id": m["build_id"], "name": m["name"], "target": m["target"],
                "source": source,
                "ranks": m["topology"]["world_size"], "files": len(m["files"]),
                "bytes": sum(f["size"] for f in m["files"]), "shards_written": self.shards_written,
                "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3),
                "did_work": self.did_work, "compile": m["compile"]["status"],
                "stages": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 3),
                            "detail": s.detail} for s in self.stages]}


# A compile killed with -9 leaves its forked pool workers holding the inherited lock until their
# PR_SET_PDEATHSIG kill has landed (moments, longer on a loaded machine): a rerun waits that long.
LOCK_GRACE_S = 5.0


@contextmanager
def _lock(out: Path):
    deadline = time.monotonic() + LOCK_GRACE_S
    while True:
        with file_lock(out / STATE_DIR / "lock", wait=False) as fd:
            if fd is not None:
                yield
                return
        if time.monotonic() > deadline:
            raise GkError(f"{out}: another gkbuild compile is writing this folder")
        time.sleep(0.1)


class _Runner:
    """A process pool whose workers report (task, bytes) to the progress bars. (The pool, the
    emission code and numpy are imported only by a build that writes: a no-op needs none of them.)"""

    def __init__(self, jobs: int, progress: Progress, preload: tuple[str, ...] = ()):
        import importlib
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        from .emit import init_worker

        for module in preload:  # imported once here, inherited by every forked worker
            importlib.import_module(module)
        ctx = mp.get_context("fork")
        self.queue = ctx.SimpleQueue()
        self.pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=init_worker,
                                        initargs=(self.queue,))
        self.progress = progress

    def drain(self) -> None:
        while not self.queue.empty():
            self.progress.advance(*self.queue.get())

    def run(self, calls: list, on_done) -> None:
        """Submit (fn, args, tag) calls in order; ``on_done(tag, result)`` as each finishes."""
        from concurrent.futures import FIRST_COMPLETED, wait

        pending = {self.pool.submit(fn, *args): tag for fn, args, tag in calls}
        try:
            while pending:
                done, _ = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                self.drain()
                for fut in done:
                    on_done(pending.pop(fut), fut.result())
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
        finally:
            self.drain()

    def close(self, cancel: bool = False) -> None:
        self.pool.shutdown(wait=True, cancel_futures=cancel)


def shard_key(plan: Plan, f: ShardFile, source_fp: str, scale_rule: str | None = None) -> str:
    """What one shard's bytes depend on: its role's parameters, its tensors, the source, the code
    (``scale_rule``: how a dense source's experts are quantized; None for an MXFP4 source)."""
    r = plan.recipe
    quantized = {"scale_rule": scale_rule, "quantizer": QUANTIZER_VERSION} if scale_rule else {}
    params = {"shared": {"tp": r.topology.tp, "rope": r.decode.rope},
              "attn": {"tp": r.topology.tp, "v_scale": _v_scale(r)},
              "expert": {"ep": r.topology.ep, "experts": r.experts, **quantized}, "tail": {"vtp": r.topology.vtp},
              "embed": {"placement": r.decode.embedding,
                        **({} if r.decode.embedding == "host" else {"tp": r.topology.tp})}}[f.role]
    specs = [[t.name, t.dtype, list(t.shape)] for t in f.tensors]
    return key("shard", f.role, f.index, params, specs, source_fp, LAYOUT_VERSION, __version__)


def _v_scale(r: Recipe) -> float:
    return r.kv_cache.v_scale if r.kv_cache.dtype == "fp8" else 1.0


def layout_docs(plan: Plan) -> dict[str, dict]:
    """The KV and tail layout metadata files a runtime reads."""
    t = plan.recipe.topology
    tail = dict(plan.tail)
    tail["owned_rows"] = {str(b): {str(c.rank): owned_rows(c.vtp, t.vtp, b, plan.recipe.hops, t.a2a_batch_groups)
                                   for c in plan.ranks}
                          for b in plan.recipe.decode.batch_sizes}
    kv = plan.kv.describe()
    # disaggregated inference: the KV heads each rank's cache holds (its TP rank's heads)
    kv["kv_heads_of_rank"] = {str(c.rank): plan.dims.kv_heads_of(c.tp) for c in plan.ranks}
    kv["budget"] = plan.budget
    return {"layout/kv.json": kv, "layout/tail.json": tail}


class _Build:
    """One run of the pipeline over one build folder; a method a stage."""

    def __init__(self, recipe: Recipe, out: Path, jobs: int, force: bool, progress: Progress):
        self.recipe, self.out, self.jobs, self.progress = recipe, out, jobs, progress
        self.state = State(out)
        if force:
            self.state.stages, self.state.shards, self.state.source = {}, {}, {}
        self.reports: list[StageReport] = []
        self.keys: dict[str, str] = {}
        self.written = self.nbytes = 0
        for p in our_temporaries(out):  # an interrupted earlier run's (nothing else writes here: we hold the lock)
            (shutil.rmtree if p.is_dir() and not p.is_symlink() else Path.unlink)(p)

    def unpublish(self) -> None:
        """Take the manifest away before the first byte of a rebuild changes: a folder with a
        manifest is always complete (the new manifest is written last)."""
        path = self.out / mf.NAME
        if path.exists() or path.is_symlink():
            path.unlink()
            signing.write_folder(self.out, None)  # a signature of the old manifest goes with it
            fsync_dir(self.out)

    def report(self, name: str, ran: bool, t0: float, detail: str = "") -> None:
        self.reports.append(StageReport(name, "ran" if ran else "cached", time.perf_counter() - t0 if ran else 0.0,
                                        detail))

    # -- resolve, validate, plan ----------------------------------------------------------------
    def _by_range(self) -> bool:
        """Whether the source is read by range (``checkpoint.ranged``) rather than from a folder:
        a synth:// one that is never written (``source.synth_by_range``)."""
        return synth_by_range(self.spec)

    def resolve(self) -> None:
        t0 = time.perf_counter()
        r = self.recipe
        self.spec = parse(r.source, base=r.path.parent if r.path else None)
        self.remote = None
        if self._by_range():
            from ..checkpoint.ranged import connect

            self.remote = connect(self.spec.uri)
            self.remote.files()  # listed once: every later read is pinned to this listing
            self.root = None
            self.report("resolve", False, t0, self.spec.uri)
            return
        synthesize = self.spec.kind == "synth" and not (synth_cache_dir(self.spec) / "config.json").exists()
        if synthesize:
            from ..checkpoint.synth import total_bytes

            self.progress.task("resolve", f"synthesize {self.spec.preset}",
                               total_bytes(synth_config(self.spec), self.spec.dtype))
        downloaded = []
        if self.spec.kind == "s3":
            self.progress.task("resolve", f"download {self.spec.uri}", 0)
        advance = self.progress.advancer("resolve")
        self.root = materialize(self.spec, advance=lambda n: (downloaded.append(n), advance(n)))
        refuse_overlap(self.out, self.root)
        self.report("resolve", synthesize or bool(downloaded), t0,
                    self.spec.uri if self.spec.kind in ("synth", "s3") else str(self.root))

    def validate(self) -> None:
        t0 = time.perf_counter()
        if self.remote is None:
            self.config = GptOssConfig.from_file(self.root / "config.json")
            self.names = sorted(["config.json"] + ([INDEX] if (self.root / INDEX).exists() else [])
                                + weight_files(self.root))
            stats = [(self.root / n).stat() for n in self.names]
            self.identity = [[n, st.st_size, st.st_mtime_ns] for n, st in zip(self.names, stats)]
            self.ckpt_root = str(self.root)
        else:  # its headers read by range and cross-checked (every time: nothing local records them)
            from ..checkpoint.ranged import RangedCheckpoint

            ck = RangedCheckpoint.open_remote(self.remote)
            self.config = ck.config
            self.names = sorted(["config.json", *([INDEX] if INDEX in self.remote.files() else []), *ck.headers])
            self.identity = [[n, self.remote.file(n).size, self.remote.file(n).tag] for n in self.names]
            self.ckpt_root = f"hf://{self.remote.ref.repo}@{self.remote.pin['commit']}" \
                if self.remote.kind == "hf" else self.remote.uri
        # Whether these exact files were validated before is remembered by name, size and mtime (in
        # the folder's state only); the manifest's stage key hashes their content (set in shards).
        checked = key("validated", self.identity, self.recipe.digest(), __version__)
        cached = self.remote is None and self.state.source.get("validated") == checked \
            and self.state.source.get("layout") in LAYOUTS
        if cached:
            self.source_layout = self.state.source["layout"]
        else:
            if self.remote is None:
                from ..checkpoint.reader import Checkpoint

                ck = Checkpoint.open(self.root)
                ck.close()
            self.source_layout = ck.layout
            self.recipe.check_against(self.config)
        # A dense (bf16/fp32) fine-tune's experts are quantized as the expert shards are written.
        self.scale_rule = None if self.source_layout == "mxfp4" else self.recipe.quantize.scale_rule
        self._validated = checked
        self.report("validate", not cached, t0,
                    f"{len(self.names)} files, headers {'read by range' if self.remote else 'checked'}"
                    + (f"; {self.source_layout} experts, quantized to MXFP4 ({self.scale_rule}) as the expert "
                       f"shards are written" if self.scale_rule else ""))

    def plan(self) -> None:
        t0 = time.perf_counter()
        self.plan_ = make_plan(self.recipe, self.config)
        self.keys["plan"] = key("plan", self.recipe.digest(), self.config.to_hf(), __version__)
        self.report("plan", self.state.stages.get("plan") != self.keys["plan"], t0,
                    f"{self.plan_.world} ranks, {len(self.plan_.files)} files")

    # -- shards ---------------------------------------------------------------------------------
    def shards(self) -> None:
        t0 = time.perf_counter()
        self.fps = Fingerprints(cache_root())
        self.digests = {n: self._lookup(self.fps, n) for n in self.names}
        unknown = [n for n in self.names if self.digests[n] is None]
        self._results: dict[str, tuple[int, str]] = {}
        self._unrecorded: list[ShardFile] = []
        self._last_sync = time.monotonic()
        self._fp = None if unknown else self.source_fp()
        runner = None
        try:
            if unknown and self.state.shards:  # hash first: the keys decide what can be kept
                runner = _Runner(self.jobs, self.progress, self._preload())
                runner.run(self._hash_calls(unknown), self._on_done)
                self.fps.save()
                unknown, self._fp = [], self.source_fp()
            todo = self._todo()
            planned = {f.path for f in self.plan_.files}
            if todo or any(p not in planned for p in self.state.shards):
                self.unpublish()
            if todo or unknown:
                # A first build with unhashed sources hashes them alongside the emission.
                from .emit import Context, ShardJob, run_shard

                runner = runner or _Runner(self.jobs, self.progress, self._preload())
                ctx = Context(self.ckpt_root, str(self.out), self.plan_.dims, self.recipe.experts,
                              _v_scale(self.recipe), self.recipe.decode.embedding,
                              self.plan_.scalars["rope"] if self.recipe.decode.rope == "fused" else None,
                              self.scale_rule)
                self.progress.task("shards", "emit shards", sum(f.nbytes for f in todo))
                calls = (self._hash_calls(unknown) if unknown else []) + [
                    (run_shard, (ctx, ShardJob(f.role, f.index, f.path, f.tensors)), ("shard", f)) for f in todo]
                calls.sort(key=lambda c: -(self._size(c[2][1]) if c[2][0] == "hash" else c[2][1].nbytes))
                runner.run(calls, self._on_done)
                if unknown:
                    self.fps.save()
                    self._fp = self.source_fp()
            self._record(force=True)
        except BaseException:
            if runner:
                runner.close(cancel=True)
            self._record(force=True)
            raise
        if runner:
            runner.close()
        keep = {f.path for f in self.plan_.files}
        for path in [p for p in self.state.shards if p not in keep]:  # an earlier plan's shards
            inside(self.out, path).unlink(missing_ok=True)
            del self.state.shards[path]
        self.state.source = {"identity": self.identity, "fingerprint": self.source_fp(), "validated": self._validated,
                             "layout": self.source_layout}
        self.keys["validate"] = key("validate", self.source_fp(), __version__)
        self.keys["shards"] = key("shards", sorted((f.path, self.state.shards[f.path]["key"])
                                                   for f in self.plan_.files))
        n = len(self.plan_.files)
        self.report("shards", bool(self.written), t0,
                    f"{self.written} of {n} written" if self.written else f"{n} up to date")

    def _preload(self) -> tuple[str, ...]:
        """What the workers import: only dequantized (bf16) experts need ml_dtypes (its casts; 0.6 s
        to import), every other shard moves bf16 as u16 bits."""
        return ("ml_dtypes",) if self.recipe.experts == "bf16" else ()

    def source_fp(self) -> str:
        return key("source", sorted(self.digests.items()))

    def _hash_calls(self, names: list[str]) -> list:
        from .emit import run_hash

        self.progress.task("hash", "hash source", sum(self._size(n) for n in names))
        return [(run_hash, (self.ckpt_root, n), ("hash", n)) for n in names]

    # -- the source's files, in a folder or read by range ----------------------------------------
    def _ident(self, name: str) -> str | None:
        """What pins a remote file's content (its location, size and ETag, commit or synth version)."""
        if self.remote is None:
            return None
        f = self.remote.file(name)
        return f"{self.ckpt_root}/{name}|{f.size}|{f.tag}"

    def _lookup(self, fps: Fingerprints, name: str) -> str | None:
        if self.remote is None:
            return fps.lookup(self.root / name)
        return self.remote.file(name).sha256 or fps.lookup_remote(self._ident(name))

    def _remember(self, fps: Fingerprints, name: str, digest: str) -> None:
        if self.remote is None:
            fps.remember(self.root / name, digest)
        else:
            fps.remember_remote(self._ident(name), digest)

    def _size(self, name: str) -> int:
        return self.remote.file(name).size if self.remote else (self.root / name).stat().st_size

    def _todo(self) -> list[ShardFile]:
        """Shards to (re)write: no record, a different key, or the file gone or resized."""
        todo = []
        for f in self.plan_.files:
            rec = self.state.shards.get(f.path)
            p = self.out / f.path
            ok = (rec is not None and self._fp is not None and rec["key"] == shard_key(self.plan_, f, self._fp, self.scale_rule)
                  and intact(p, rec))  # re-verified: a file edited since it was written is written again
            if not ok:
                todo.append(f)
        return todo

    def _on_done(self, tag, result) -> None:
        kind, obj = tag
        if kind == "hash":
            self.digests[obj] = result[1]
            self._remember(self.fps, obj, result[1])
            return
        path, size, sha = result
        self._results[path] = (size, sha)
        self._unrecorded.append(obj)
        self.written, self.nbytes = self.written + 1, self.nbytes + size
        self._record()

    def _record(self, force: bool = False) -> None:
        """Sync the output filesystem, then record the finished shards: a shard in the state is
        durable, so a resume after a kill or a power loss never trusts a torn file."""
        if self._fp is None or not self._unrecorded:
            return
        if not force and time.monotonic() - self._last_sync < SYNC_INTERVAL:
            return
        syncfs(self.out)
        for f in self._unrecorded:
            size, sha = self._results[f.path]
            self.state.shards[f.path] = {"key": shard_key(self.plan_, f, self._fp, self.scale_rule), "size": size, "sha256": sha,
                                         "stat": stat_of(self.out / f.path)}
        self._unrecorded.clear()
        self.state.save()
        self._last_sync = time.monotonic()

    # -- layout metadata, compile, manifest -------------------------------------------------------
    def layout(self) -> None:
        t0 = time.perf_counter()
        docs = layout_docs(self.plan_)
        self.keys["layout"] = key("layout", docs, __version__)
        data = {p: dumps_strict(doc) for p, doc in docs.items()}
        cached = self.state.stages.get("layout") == self.keys["layout"] and all(
            os.path.isfile(self.out / p) and os.path.getsize(self.out / p) == len(b) and (self.out / p).read_bytes() == b
            for p, b in data.items())
        if not cached:  # re-verified: metadata edited since it was written is written again
            self.unpublish()
            for p, b in data.items():
                write_bytes_atomic(inside(self.out, p), b)
        self.layout_files = [{"path": p, "size": (self.out / p).stat().st_size,
                              "sha256": sha256_file(self.out / p), "role": "layout"} for p in docs]
        self.report("layout", not cached, t0, ", ".join(docs))

    def compile(self, enabled: bool, require_neff: bool, shared=None) -> None:
        """``shared``: the compile cache (``CompileCache``) or None."""
        t0 = time.perf_counter()
        if not enabled:
            self.compile_entry = {"status": "skipped: not requested (--no-compile)", "artifacts": []}
            self.keys["compile"] = key("compile", "not requested")
            self.reports.append(StageReport("compile", "skipped", 0.0, "--no-compile"))
            return
        from ..compile import stage

        self.compile_entry, self.keys["compile"], status, detail = stage.run(self.plan_, self.out, self.state,
                                                                             self.progress, require_neff,
                                                                             before_write=self.unpublish, cache=shared)
        self.reports.append(StageReport("compile", status, time.perf_counter() - t0, detail))

    def manifest(self) -> dict:
        t0 = time.perf_counter()
        shards = [{"path": f.path, "size": self.state.shards[f.path]["size"],
                   "sha256": self.state.shards[f.path]["sha256"], "role": f.role, "index": f.index,
                   "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in f.tensors]}
                  for f in self.plan_.files]
        artifacts = [{"path": a["path"], "size": a["size"], "sha256": a["sha256"], "role": "artifact"}
                     for a in self.compile_entry["artifacts"] if a.get("path")]
        stages = [{"name": n, "key": self.keys[n]} for n in ("validate", "plan", "shards", "layout", "compile")]
        source, files = self._source_info(), shards + self.layout_files + artifacts
        # Everything the manifest is made of: when it and the file (by its stat) are as the last build
        # left them, the file is read back instead of assembled and hashed again (0.2 s for 128 ranks).
        inputs = key("manifest inputs", mf.SCHEMA_VERSION, self.keys["plan"], source, files, stages,
                     self.compile_entry, mf.tool_versions(), __version__)
        path = self.out / mf.NAME
        m = self._unchanged_manifest(path, inputs)
        if m is None:
            m = mf.make(self.plan_, source, files, stages, self.compile_entry)
        self.keys["manifest"] = key("manifest", m["build_id"])
        cached = self.state.stages.get("manifest") == self.keys["manifest"] and path.exists()
        if not cached:
            mf.write(path, m)
        self.keys["manifest inputs"] = key(inputs, stat_of(path))
        self.report("manifest", not cached, t0, m["build_id"][:16])
        self.state.stages.update(self.keys)
        self.state.save()
        return m

    def _unchanged_manifest(self, path: Path, inputs: str) -> dict | None:
        """The manifest file, when the last build wrote it from these same ``inputs`` and it is
        untouched since (its stat, as for shards); else None."""
        import json

        try:
            if self.state.stages.get("manifest inputs") != key(inputs, stat_of(path)):
                return None
            m = json.loads(mf.read_bytes(self.out))  # ours, by its stat: parsed without the depth walk
        except (OSError, ValueError, GkError):
            return None
        ok = isinstance(m, dict) and self.state.stages.get("manifest") == key("manifest", m.get("build_id"))
        return m if ok else None

    def _source_info(self) -> dict:
        info = self.spec.describe()
        if self.spec.kind == "hf" and self.remote:
            info.update(repo=self.remote.ref.repo, revision=self.remote.ref.revision, commit=self.remote.pin["commit"])
        elif self.spec.kind == "hf":
            from ..checkpoint.hub import parse as parse_hf

            ref = parse_hf(self.spec.uri)
            info.update(repo=ref.repo, revision=ref.revision, commit=self.root.name)
        info["files"] = [{"name": n, "size": self._size(n), "sha256": self.digests[n]} for n in self.names]
        if self.scale_rule:
            info.update(layout=self.source_layout, quantize={"scale_rule": self.scale_rule, "quantizer": QUANTIZER_VERSION})
        return info


def refuse_overlap(out: Path, source: Path) -> None:
    src, dst = resolved(source, "source"), resolved(out, "output folder")
    if dst == src or src in dst.parents or dst in src.parents:
        raise GkError(f"{out}: the output folder and the source checkpoint {source} overlap; build into a "
                      f"folder outside the checkpoint")


def default_jobs() -> int:
    """One worker more than the cores: a worker that ends a shard waits for its last direct
    writes to reach the disk, and the spare one keeps the cores busy meanwhile (2 cores, 120b
    shapes: 8.5 s a build against 9.9 s with two workers)."""
    return (os.cpu_count() or 1) + 1


def open_cache(cache: str | None, push: bool, compile: bool, out: Path):
    """The compile cache a build looks programs up in (``CompileCache``), or None. Opened before any
    work: a location that is no store is refused now, not skipped later."""
    if not (cache and compile):
        return None
    from ..compile.cache import CompileCache

    return CompileCache(cache, push, staging=out / STATE_DIR / "cache-push")


def compile_build(recipe: Recipe, out: Path | None = None, jobs: int | None = None, force: bool = False,
                  quiet: bool = False, compile: bool = True, require_neff: bool = False, cache: str | None = None,
                  cache_push: bool = False) -> BuildResult:
    """Run every stage of a build into ``out`` (default: the recipe's output folder). ``compile``
    False stops after the layout metadata (shards, metadata and manifest only). ``cache``: a
    compile-cache store looked up before compiling (``cache_push``: and stored to after)."""
    t0 = time.perf_counter()
    out = Path(out) if out else recipe.output_dir()
    spec = parse(recipe.source, base=recipe.path.parent if recipe.path else None)
    if spec.kind == "dir":
        refuse_overlap(out, Path(spec.path))  # before the folder is even created
    if compile:  # what plan refuses is refused before anything is written
        from ..checkpoint.source import model_config
        from ..compile.stage import refuse_unbuildable

        refuse_unbuildable(recipe, model_config(spec))
    shared = open_cache(cache, cache_push, compile, out)
    claim(out)
    with _lock(out), Progress(quiet) as progress:
        b = _Build(recipe, out, jobs or default_jobs(), force, progress)
        b.resolve()
        b.validate()
        b.plan()
        b.shards()
        b.layout()
        b.compile(compile, require_neff, shared)
        m = b.manifest()
    return BuildResult(out, b.reports, m, b.written, b.nbytes, time.perf_counter() - t0)
