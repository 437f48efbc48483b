"""``gkbuild compile RECIPE --to STORE``: a build streamed from its source straight into a store,
on bounded local disk.

The stages are ``compile``'s (the same plan, keys, metadata, compile stage and manifest, so the
build id is the same), with three differences:
- the source is read by byte range, one tensor (or slice) at a time (``checkpoint.ranged``):
  ``s3://`` and ``hf://`` are never mirrored, nor is a ``synth://`` source read by range
  (``source.synth_by_range``: generated as it is read); a folder or another ``synth://`` is
  memory-mapped as usual;
- each shard is written to a staging file, stored as a blob (``publish.put_blob``: the encoding
  publish would choose, hashed on the way) and deleted; how many shards are staged at once is
  bounded by ``--scratch-limit``, which must hold at least the largest shard (for the hub, also its
  blob: it is staged whole, its content sent, then committed to the build's own branch, from which
  the final commit copies it);
- the index and manifest are committed last in one step (``publish``'s commit), under a lease
  taken before the first blob is sent, so a concurrent ``--prune`` keeps off and a killed build
  leaves nothing visible. A rerun skips the shards whose blobs its state records and the store
  holds (verified as publish verifies a reused blob), and re-sends no blob the store has.

Everything local lives in ``$GKBUILD_CACHE/stream/<name>-<store>/`` (state, metadata, compiled
programs, staging); its disk use is sampled through the build and reported as the peak.
Shard jobs run in local worker processes or, with ``--executor ray``, as Ray tasks that read
their own ranges and send their own blobs (``stream_ray``); the driver plans, collects the
records and commits.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

from .. import __version__
from ..checkpoint.source import cache_root
from ..errors import GkError
from ..paths import STATE_DIR, claim, inside, resolved
from ..plan import ShardFile
from ..progress import Progress
from ..publish.leases import Lease
from ..publish.publish import _publish, _stored_entry, put_blob, signed_build
from ..publish.stores import DirStore, HubStore, open_store
from ..recipe import Recipe
from ..summary import human_bytes
from .emit import Context, ShardJob, run_shard, use_checkpoint
from .fingerprint import Fingerprints, sha256_file
from .pipeline import SYNC_INTERVAL, BuildResult, _Build, _lock, _Runner, _v_scale, default_jobs, open_cache, shard_key
from .state import key

DEFAULT_SCRATCH = 4 << 30
HEADER_ROOM = 1 << 20  # a staged shard's safetensors header and alignment, over its tensor bytes
SAMPLE_EVERY = 0.02  # seconds between samples of the local disk in use


@dataclass(frozen=True)
class StreamJob:
    """A group of consecutive shards of one role (a rank group), as a worker (a local process or a
    Ray task) runs it: one shard at a time, each staged, stored and deleted before the next."""

    ctx: Context  # ckpt_root: a folder, or the remote URI; out_dir: the staging folder ("" = the worker's own)
    jobs: tuple[ShardJob, ...]
    store: str
    pin: dict  # what the driver listed of a remote source (ranged.Remote)
    stored: dict  # blob name -> size, as the driver listed the store
    level: int
    hub: HubStore | None = None  # a hub store as its workers use it (``HubStore.streaming``); else the URI is opened

    @property
    def nbytes(self) -> int:
        return sum(j.nbytes for j in self.jobs)

    @property
    def staging(self) -> int:
        """The local disk it needs at most: its largest shard, staged (and, for the hub, its blob)."""
        return max(j.nbytes for j in self.jobs) * (2 if self.hub else 1) + HEADER_ROOM

    @property
    def name(self) -> str:
        return self.jobs[0].path if len(self.jobs) == 1 else f"{self.jobs[0].path}..{self.jobs[-1].path}"


_remote: dict = {}
_stores: dict = {}


def run_stream_shard(sj: StreamJob) -> list[dict]:
    """Emit each shard of the group into staging, store it as a blob, delete the staged file: each
    shard's record (path, size, sha256, index entry, whether its blob was sent, source bytes read).
    A Ray task (no ``out_dir``: it stages under its node's cache) also records the peak its node's
    staging folder reached while it ran (``node_disk``; concurrent tasks on the node are in it), which
    the driver, on another host, cannot see."""
    import contextlib
    import shutil
    import uuid

    ck = None
    if "://" in sj.ctx.ckpt_root:
        from ..checkpoint.ranged import RangedCheckpoint, connect

        if sj.ctx.ckpt_root not in _remote:
            _remote[sj.ctx.ckpt_root] = RangedCheckpoint.open_remote(connect(sj.ctx.ckpt_root, sj.pin), plain=True)
        ck = _remote[sj.ctx.ckpt_root]
        use_checkpoint(sj.ctx.ckpt_root, ck)
    if sj.store not in _stores:
        _stores[sj.store] = sj.hub or open_store(sj.store)
    store = _stores[sj.store]
    own = not sj.ctx.out_dir
    staging = worker_staging() / uuid.uuid4().hex if own else Path(sj.ctx.out_dir)
    if sj.hub:
        store.staging = staging / "weights"  # a blob beside its shard (a killed run's are cleared with them)
    ctx = replace(sj.ctx, out_dir=str(staging))
    first, end = sj.jobs[0].index, sj.jobs[-1].index + 1
    out = []
    watch = DiskWatch(worker_staging()) if own else contextlib.nullcontext()
    try:
        with watch:
            _emit_group(sj, ctx, ck, store, staging, first, end, out)
    finally:
        if ck:
            ck.group = None
        if own:
            shutil.rmtree(staging, ignore_errors=True)
    if own:
        for r in out:
            r["node_disk"] = watch.peak
    return out


def _emit_group(sj: StreamJob, ctx: Context, ck, store, staging: Path, first: int, end: int, out: list) -> None:
    """``run_stream_shard``'s loop: each shard emitted, stored as a blob, unstaged; its record appended."""
    for job in sj.jobs:
        before = ck.fetched if ck else 0
        if ck:
            ck.group = (first, end, job.index)
        try:
            path, size, sha = run_shard(ctx, job)
            f = {"path": path, "size": size, "sha256": sha, "src": inside(staging, path)}
            entry, sent, nbytes = put_blob(f, sj.stored, store, sj.level)
        finally:
            inside(staging, job.path).unlink(missing_ok=True)
        out.append({"path": path, "size": size, "sha256": sha, "entry": entry, "sent": sent is not None,
                    "sent_bytes": nbytes, "read": ck.fetched - before if ck else 0,
                    "op": store.uncommitted.pop(sent) if sj.hub and sent else None})


def worker_staging() -> Path:
    """Where a Ray task stages its shard: under its node's own gkbuild cache."""
    return cache_root() / "stream" / "staging"


class DiskWatch:
    """The bytes allocated under some folders, sampled in a thread: the peak is what the build
    reports (and what ``--scratch-limit`` bounds)."""

    def __init__(self, *roots: Path):
        self.roots, self.peak, self._stop = roots, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        n = 0
        for root in self.roots:
            for dirpath, _, files in os.walk(root):
                for name in files:
                    try:
                        st = os.lstat(os.path.join(dirpath, name))
                    except FileNotFoundError:
                        continue
                    n += max(st.st_blocks * 512, st.st_size)
        return n

    def sample(self) -> int:
        now = self.used()
        self.peak = max(self.peak, now)
        return now

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self.sample()

    def __enter__(self) -> "DiskWatch":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def scratch_folder(recipe: Recipe, store_uri: str) -> Path:
    """Where a streamed build keeps its state, metadata and staging: one folder per recipe name
    and store, so a rerun finds what the killed run recorded."""
    tag = hashlib.sha256(store_uri.encode()).hexdigest()[:12]
    return cache_root() / "stream" / f"{recipe.name}-{tag}"


class _StreamBuild(_Build):
    """``_Build`` with a ranged source and shards that go into the store instead of the folder."""

    def __init__(self, recipe: Recipe, out: Path, jobs: int, force: bool, progress: Progress, store, limit: int,
                 executor: str, level: int):
        super().__init__(recipe, out, jobs, force, progress)
        self.store, self.limit, self.executor, self.level = store, limit, executor, level
        self.known: dict[str, dict] = {}  # shard path -> its index entry (in the store)
        self.counts = {"sent": 0, "sent_bytes": 0, "reused": 0, "skipped": 0, "read": 0, "node_disk": 0}
        for leftover in (out / "weights").glob("*") if (out / "weights").is_dir() else []:
            leftover.unlink()  # a killed run's staged shards (this folder is gkbuild's: claimed)

    def _by_range(self) -> bool:
        return self.spec.kind in ("s3", "hf") or super()._by_range()

    def _hash(self, name: str) -> str:
        advance = self.progress.advancer("hash")
        if self.remote is None:
            return sha256_file(self.root / name, advance)
        return self.remote.sha256(name, advance)

    # -- shards ----------------------------------------------------------------------------------
    def check_scratch(self) -> None:
        """Refuse to start when the limit cannot stage the largest shard next to the metadata."""
        big = max(self.plan_.files, key=lambda f: f.nbytes)
        hub = isinstance(self.store, HubStore)  # its blob is staged whole beside it
        need = (2 if hub else 1) * big.nbytes + HEADER_ROOM + self.base_use
        if need > self.limit:
            raise GkError(f"--scratch-limit {human_bytes(self.limit)}: cannot stage the largest shard, {big.path} "
                          f"({human_bytes(big.nbytes)}{', and its blob' if hub else ''}, plus "
                          f"{human_bytes(self.base_use + HEADER_ROOM)} of state and headers); give at least "
                          f"{human_bytes(need)}")

    def shards(self) -> None:
        t0 = time.perf_counter()
        self._fps = Fingerprints(cache_root())
        self.digests = {n: self._lookup(self._fps, n) for n in self.names}
        unknown = [n for n in self.names if self.digests[n] is None]
        self.hash_read = sum(self._size(n) for n in unknown) if self.remote else 0
        self._results: dict[str, dict] = {}
        self._unrecorded: list[str] = []
        self._last_sync = time.monotonic()
        runner = None
        if self.executor == "local":  # its processes fork before any hashing thread starts
            runner = _Runner(self.jobs, self.progress)
            runner.pool.submit(int).result()
        self.progress.task("hash", "hash source", self.hash_read if self.remote else 0)
        hasher = ThreadPoolExecutor(4)
        self._hashing = {n: hasher.submit(self._hash, n) for n in unknown}
        try:
            if self._hashing and self.state.shards:  # the keys decide what a rerun keeps
                self._hashed(wait=True)
            fp = self.source_fp() if not self._hashing else None
            stored = self.store.stored()
            todo = []
            for f in self.plan_.files:
                rec = self.state.shards.get(f.path)
                if fp and rec and "entry" in rec and rec["key"] == shard_key(self.plan_, f, fp, self.scale_rule):
                    e = _stored_entry({"path": f.path, "size": rec["size"], "sha256": rec["sha256"]}, stored,
                                      self.store)
                    if e is not None and e == {**rec["entry"], "path": f.path}:
                        self.known[f.path] = e
                        self.counts["skipped"] += 1
                        continue
                todo.append(f)
            if todo:
                self._emit(todo, stored, runner)
            self._hashed(wait=True)
        except BaseException:
            if runner:
                runner.close(cancel=True)
            raise
        finally:
            hasher.shutdown(wait=True, cancel_futures=True)
            self._record(force=True)
        if runner:
            runner.close()
        fp = self.source_fp()
        keep = {f.path for f in self.plan_.files}
        self.state.shards = {p: r for p, r in self.state.shards.items() if p in keep}
        self.state.source = {"identity": self.identity, "fingerprint": fp, "validated": self._validated}
        self.state.save()
        self.keys["validate"] = key("validate", fp, __version__)
        self.keys["shards"] = key("shards", sorted((f.path, self.state.shards[f.path]["key"])
                                                   for f in self.plan_.files))
        n = len(self.plan_.files)
        self.written = len(self._results)
        self.nbytes = sum(r["size"] for r in self._results.values())
        c = self.counts
        self.report("shards", bool(todo), t0, f"{len(todo)} of {n} streamed ({c['sent']} blobs sent, "
                                              f"{human_bytes(c['sent_bytes'])}; {c['reused']} already stored), "
                                              f"{c['skipped']} recorded" if todo else f"{n} already in the store")

    def _hashed(self, wait: bool) -> bool:
        """Whether every source file's sha256 is known (collecting the hashing threads' results;
        ``wait``: for them to finish)."""
        if self._hashing and (wait or all(f.done() for f in self._hashing.values())):
            for n, fut in self._hashing.items():
                self.digests[n] = fut.result()
                self._remember(self._fps, n, self.digests[n])
            self._fps.save()
            self._hashing = {}
        return not self._hashing

    def _record(self, force: bool = False) -> None:
        """Record the shards stored so far in the state (once the source's hashes, which their keys
        hold, are known), at most every ``SYNC_INTERVAL`` seconds: a killed build's rerun skips them."""
        if not self._unrecorded or not self._hashed(wait=False):
            return
        if not force and time.monotonic() - self._last_sync < SYNC_INTERVAL:
            return
        fp = self.source_fp()
        files = {f.path: f for f in self.plan_.files}
        for path in self._unrecorded:
            r = self._results[path]
            self.state.shards[path] = {"key": shard_key(self.plan_, files[path], fp, self.scale_rule), "size": r["size"],
                                       "sha256": r["sha256"], "entry": r["entry"]}
        self._unrecorded.clear()
        self.state.save()
        self._last_sync = time.monotonic()

    def _emit(self, todo: list[ShardFile], stored: dict, runner) -> None:
        staging = self.out  # local workers stage into this folder's weights/
        ctx = Context(self.ckpt_root, str(staging) if self.executor == "local" else "", self.plan_.dims,
                      self.recipe.experts, _v_scale(self.recipe), self.recipe.decode.embedding,
                      self.plan_.scalars["rope"] if self.recipe.decode.rope == "fused" else None, self.scale_rule)
        pin = self.remote.pin if self.remote else {}
        jobs = sorted((StreamJob(ctx, tuple(ShardJob(f.role, f.index, f.path, f.tensors) for f in g), self.store.uri,
                                 pin, stored, self.level, self.hub) for g in rank_groups(todo, 2 * self.jobs)),
                      key=lambda j: -j.nbytes)
        budget = self.limit - self.base_use
        self.progress.task("shards", "stream shards", sum(f.nbytes for f in todo))

        def done(sj: StreamJob, records: list[dict]) -> None:
            c = self.counts
            for r in records:
                self._results[r["path"]] = r
                self._unrecorded.append(r["path"])
                self.known[r["path"]] = r["entry"]
                c["sent" if r["sent"] else "reused"] += 1
                c["sent_bytes"] += r["sent_bytes"]
                c["read"] += r["read"]
                c["node_disk"] = max(c["node_disk"], r.get("node_disk", 0))
            if self.hub:  # on the build's own branch, a rerun finds them
                self.store.commit_side([r["op"] for r in records if r["op"]])
            if self.executor != "local":
                self.progress.advance("shards", sj.nbytes)
            if self.lease:
                self.lease.renew()
            self._record()

        if self.executor == "local":
            run_local(jobs, runner, self.jobs, budget, done)
        else:
            from .stream_ray import run as run_ray

            run_ray(jobs, self.executor, budget, done)


def rank_groups(files: list[ShardFile], per_role: int) -> list[list[ShardFile]]:
    """The shards as jobs: each role's shards in index order, cut into at most ``per_role`` runs of
    consecutive indices (a job reads its group's rows of a tensor at once: see ``ranged``)."""
    out = []
    for role in dict.fromkeys(f.role for f in files):
        mine = sorted((f for f in files if f.role == role), key=lambda f: f.index)
        size = -(-len(mine) // per_role)
        run: list[ShardFile] = []
        for f in mine:
            if run and (len(run) == size or f.index != run[-1].index + 1):
                out.append(run)
                run = []
            run.append(f)
        out.append(run)
    return out


def run_local(jobs: list[StreamJob], runner: _Runner, workers: int, budget: int, on_done) -> None:
    """The jobs in the runner's ``workers`` processes, as many at once as their staging fits ``budget``."""
    queue, pending, used = list(jobs), {}, 0
    try:
        while queue or pending:
            while queue and len(pending) < workers and (not pending or used + queue[0].staging <= budget):
                sj = queue.pop(0)
                pending[runner.pool.submit(run_stream_shard, sj)] = sj
                used += sj.staging
            finished, _ = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            runner.drain()
            for fut in finished:
                sj = pending.pop(fut)
                used -= sj.staging
                on_done(sj, fut.result())
    finally:
        runner.drain()


def stream_jobs() -> int:
    """Shard jobs at once by default: at least 4, a job waits on the network much of its time."""
    return max(4, default_jobs())


def stream_build(recipe: Recipe, to: str, scratch_limit: int = DEFAULT_SCRATCH, executor: str = "local",
                 jobs: int | None = None, force: bool = False, quiet: bool = False, compile: bool = True,
                 require_neff: bool = False, cache: str | None = None, cache_push: bool = False,
                 level: int | None = None, sign: str | None = None, api=None, fs=None) -> BuildResult:
    """Build ``recipe`` into the store ``to`` (a folder, ``s3://`` or ``hf://``); the result's
    ``stream`` holds the peak local disk, the blobs sent and the source bytes read. ``sign``: as
    ``publish --sign`` (a private key's PEM file, or ``sigstore``). ``api``/``fs``: as ``publish``'s."""
    from ..publish import codec

    t0 = time.perf_counter()
    store = open_store(to, api=api, fs=fs)
    if isinstance(store, DirStore):  # workers elsewhere (Ray) open it by an absolute path
        store = open_store(str(resolved(to, "--to")))
    hub = isinstance(store, HubStore)
    if hub:
        store.check_stream()  # a token, the repo and the branch, before any work
    out = scratch_folder(recipe, store.uri)
    if hub:
        store.staging = out / STATE_DIR / "publish"  # the index's and metadata's blobs, as publish stages them
    shared = open_cache(cache, cache_push, compile, out)
    claim(out)
    with _lock(out), Progress(quiet) as progress, DiskWatch(out, worker_staging()) as disk:
        b = _StreamBuild(recipe, out, jobs or stream_jobs(), force, progress, store, scratch_limit, executor,
                         codec.LEVEL if level is None else level)
        b.lease, b.hub = None, None
        b.resolve()
        b.validate()
        if compile:  # what plan refuses is refused before the store is touched (its config, read by range)
            from ..compile.stage import refuse_unbuildable

            refuse_unbuildable(recipe, b.config)
        b.plan()
        b.base_use = disk.sample()
        b.check_scratch()
        store.prepare()
        if hub:  # its own branch: the blobs it sends are committed there until its one commit
            store.open_side(f"gkbuild-stream-{out.name}")
            b.hub = store.streaming()
        lease = Lease(store) if store.leases else None
        try:
            if lease:
                b.lease = lease.__enter__()
            b.shards()
            b.layout()
            b.compile(compile, require_neff, shared)
            m = b.manifest()
            report = _publish(signed_build(out, sign), store, b.level, None, False, True, lease, known=b.known)
        finally:
            if lease:
                lease.__exit__(None, None, None)
    res = BuildResult(out, b.reports, m, b.written, b.nbytes, time.perf_counter() - t0)
    source_bytes = sum(b._size(n) for n in b.names)
    res.stream = {"store": store.uri, "where": report.get("where"), "scratch": str(out),
                  "scratch_limit": scratch_limit, "peak_disk": disk.peak, "executor": executor,
                  "peak_disk_workers": b.counts["node_disk"] if executor != "local" else None,
                  "blobs_sent": b.counts["sent"] + report["uploaded_files"],
                  "bytes_sent": b.counts["sent_bytes"] + report["uploaded_bytes"],
                  "shards_already_stored": b.counts["reused"] + b.counts["skipped"],
                  "source_bytes": source_bytes, "source_read": b.counts["read"] + b.hash_read,
                  "source_hashed": b.hash_read}
    return res
