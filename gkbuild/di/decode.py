"""The decode side of a DI transfer: a build's KV cache filled from a prefill engine over NIXL.

``pull`` runs before a session's first decode step: the prefill computes the prompts (at N-1
tokens), the session admits the requests with N-1 computed positions (block ids allocated, no step
run), every decode rank's KV tensors are registered with one NIXL agent, the plan turns each
(rank, row) into READ descriptors from the prefill ranks' regions, and only when every READ is
done are the received packed-FP8 K blocks relaid and the first step allowed. An error or a
timeout is one line and no step runs on a partial cache.

Every exchange with the prefill (the handshake, its prefill of the prompts, the READs, the
release of its blocks) has the transfer timeout as its deadline, the time between frames
included. Before any READ is posted, the prefill's answer is held to the run: it computed the N-1
positions asked for, handed over a block for each block of them, and the plan's reads cover
every block of every layer's K and V whole (NIXL's DONE on every READ then means the bytes
arrived).

A real decode deployment has an agent a rank (vLLM: a TP worker); the emulated world here has one
agent for the process, registering every rank's K and V tensors: the descriptors are the same.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import GkError, shown
from ..layout.kv import pack_block
from . import nixl, wire
from .plan import block_pairs, covering_lengths, descriptors, received_k_blocks, shortfall, transfer_plan

_agents = count()
STARTUP_TIMEOUT = 300.0  # s: a prefill process imports torch and transformers, opens its checkpoint
SHUTDOWN_TIMEOUT = 5.0  # s: a prefill process we started says bye
NO_STEP = "; no decode step ran"


@dataclass
class Prefill:
    """How ``verify`` gets its KV: a prefill engine of ``tp`` ranks, the one listening at
    ``endpoint`` (host, port) or one started for the run; ``edit`` changes the transfer plan
    before it is used (a test's faulty plan); ``timeout``: seconds each exchange with the engine
    (handshake, prefill, the READs of a request, release) must finish in."""

    tp: int = 4
    endpoint: tuple[str, int] | None = None
    edit: Callable[[dict], dict] | None = None
    timeout: float = 60.0
    stats: dict = field(default_factory=dict)  # what the last pull moved: bytes, reads, seconds


def plan_of(build, prefill_tp: int, num_blocks: int | None = None) -> dict:
    """The transfer plan of an open build (``runtime.Build``) from its kv.json (checked), for KV
    tensors of ``num_blocks`` blocks (default: the build's; a verify allocates only the blocks it
    reaches, which moves every entry's offset)."""
    lay = build.kv_layout()
    doc = build.layout_doc("kv")
    if num_blocks is not None and num_blocks != lay.num_blocks:
        doc = dict(doc, **dataclasses.replace(lay, num_blocks=num_blocks).describe())
    return transfer_plan(doc, prefill_tp, build.manifest["model"]["sliding_window"])


# -- the prefill engine's process and side channel ----------------------------------------------
def prefill_args(build, tp: int, num_blocks: int) -> list[str]:
    """The prefill engine for a build: its source checkpoint, the build's KV format and block size."""
    from ..checkpoint.source import materialize, parse
    from ..reference import build_kv, build_rule

    m = build.manifest
    root = materialize(parse(m["source"]["uri"], base=Path.cwd()))
    fmt = build_kv(m)
    return ["--checkpoint", str(root), "--kv", fmt.dtype, "--k-scale", repr(fmt.k_scale), "--v-scale",
            repr(fmt.v_scale), "--block-size", str(m["layout"]["kv"]["block_size"]), "--tp", str(tp),
            "--num-blocks", str(num_blocks), "--scale-rule", build_rule(m)]


def pool_blocks(prompts: int, length: int, block: int, window: int) -> int:
    """Blocks a prefill pool needs for ``prompts`` prompts of ``length`` tokens: the full group's
    and the sliding group's (the window's ceil(W/block) + 1) for each."""
    return prompts * (-(-length // block) + -(-window // block) + 1)


@contextmanager
def serving(build_dir, tp: int, golden_file, prompts: int | None, timeout: float, steps: int):
    """A prefill engine for a verify of ``build_dir`` (the CLI's ``--prefill nixl``): yields the
    ``Prefill`` to pass to ``verify.run`` and the prompt lengths to run: the golden's, or
    ``covering_lengths`` of the build's block and window. A run the build's KV budget cannot hold
    (``steps`` after the longest prompt) is refused before the process starts."""
    from ..golden import Golden
    from ..kernels.driver import check_run
    from ..runtime import Build

    build = Build.open(build_dir)
    try:
        m = build.manifest
        block, window = m["layout"]["kv"]["block_size"], m["model"]["sliding_window"]
        batch = max(m["recipe"]["resolved"]["decode"]["batch_sizes"])
        if golden_file is not None:
            g = Golden.load(golden_file)
            count, lengths, positions = g.token_ids.shape[0], [g.prompt_len], g.token_ids.shape[1]
        else:
            count = prompts or min(4, batch)
            lengths = covering_lengths(block, window)
            positions = max(lengths) + steps
        check_run(m, build.kv_layout(), batch, positions)  # before a prefill process is started
        args = prefill_args(build, tp, pool_blocks(count, max(lengths), block, window))
    finally:
        build.close()
    with prefill_process(args) as (endpoint, _):
        yield Prefill(tp=tp, endpoint=endpoint, timeout=timeout), lengths


@contextmanager
def prefill_process(args: list[str], startup_timeout: float = STARTUP_TIMEOUT):
    """A prefill engine in its own process on 127.0.0.1: yields ((host, port), the process);
    shut down (then killed if it lingers) on the way out. Its stderr's last line explains a
    failed start."""
    nixl.api()  # one line, before a process is started, where NIXL is missing
    nixl.loopback_env()
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "gkbuild.di.prefill", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, env=dict(os.environ, OMP_NUM_THREADS="1"))
    port = None
    try:
        port = _ready(proc, startup_timeout, err)
        yield ("127.0.0.1", port), proc
    finally:
        _stop(proc, None if port is None else ("127.0.0.1", port))
        err.close()


def _ready(proc: subprocess.Popen, timeout: float, err) -> int:
    """The port of a starting prefill process's ``READY <port>`` line (other lines are its log)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            words = line.split()
            if len(words) == 2 and words[0] == b"READY":
                return wire.digits(words[1].decode("ascii", "replace"), "the prefill's port", 1, 65536)
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left) or len(buf) > 1 << 20:
            raise GkError(f"the prefill process did not say READY within {timeout:g} s")
        chunk = proc.stdout.read1(1 << 12)
        if not chunk:
            proc.wait()
            err.seek(0)
            last = (err.read().decode(errors="replace").strip().splitlines() or ["no message"])[-1]
            raise GkError(f"the prefill process exited ({proc.returncode}): {last[:300]}")
        buf += chunk


def _stop(proc: subprocess.Popen, endpoint) -> None:
    if proc.poll() is None and endpoint is not None:
        try:
            deadline = wire.Deadline(SHUTDOWN_TIMEOUT, "shutdown")
            with socket.create_connection(endpoint, timeout=SHUTDOWN_TIMEOUT) as s:
                wire.send(s, {"op": "shutdown"}, "prefill shutdown", deadline)
                wire.recv(s, "prefill shutdown", deadline)
        except (GkError, OSError):
            pass
    if proc.stdin:
        proc.stdin.close()  # the prefill exits when its stdin closes
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


class Peer:
    """The decode side's connection to a prefill engine: its engine description and ranks. Each
    exchange (handshake, prefill, release) must complete within ``timeout`` seconds."""

    def __init__(self, endpoint: tuple[str, int], timeout: float = 60.0):
        self.where = f"prefill at {endpoint[0]}:{endpoint[1]}"
        self.timeout = timeout
        deadline = self._deadline("handshake")
        try:
            self.sock = socket.create_connection(endpoint, timeout=deadline.left(self.where))
        except socket.timeout:
            raise deadline.expired(self.where) from None
        except OSError as e:
            raise GkError(f"{self.where}: {e.strerror or e}") from None
        try:
            self._hello(deadline)
        except GkError:
            self.sock.close()
            raise

    def _deadline(self, phase: str) -> wire.Deadline:
        return wire.Deadline(self.timeout, phase, f" (--transfer-timeout){NO_STEP}")

    def _hello(self, deadline: wire.Deadline) -> None:
        wire.send(self.sock, {"op": "hello", "version": wire.VERSION}, self.where, deadline)
        hello = wire.expect(self.sock, "hello", self.where, deadline)
        if hello.get("version") != wire.VERSION:
            raise GkError(f"{self.where}: speaks side-channel version {shown(hello.get('version'))}, not {wire.VERSION}")
        self.engine = hello.get("engine")
        self.ranks = hello.get("ranks")
        if not isinstance(self.engine, dict) or not isinstance(self.ranks, list):
            raise GkError(f"{self.where}: a hello without its engine and ranks")

    def check(self, plan: dict, fmt) -> None:
        """The engine is the one the plan reads from: same TP, KV format, geometry; each rank's
        regions as many as the plan's and each a whole pool of blocks."""
        e, p, d = self.engine, plan["prefill"], plan["decode"]
        want = {"tp": p["tp"], "kv_heads": p["kv_heads"], "num_layers": d["num_layers"], "block_size": d["block_size"],
                "head_dim": d["head_dim"], "block_len": p["block_len"], "buffers": p["buffers"], "kv": fmt.to_meta(),
                "window": plan["window"], "layout": "per_buffer"}
        for k, v in want.items():
            if e.get(k) != v:
                raise GkError(f"{self.where}: its {k} is {shown(e.get(k))}, the build's plan needs {shown(v)}")
        self.num_blocks = wire.integer(e.get("num_blocks"), "num_blocks", 1, 1 << 31)
        self.block = d["block_size"]
        if len(self.ranks) != p["tp"]:
            raise GkError(f"{self.where}: {len(self.ranks)} ranks described, its TP is {p['tp']}")
        self.regions = []
        for i, r in enumerate(self.ranks):
            regs = r.get("regions") if isinstance(r, dict) else None
            if not isinstance(regs, list) or len(regs) != len(p["regions"]):
                raise GkError(f"{self.where}: rank {i} registers {shown(regs)}, not the plan's {len(p['regions'])} regions")
            if r.get("heads") != p["heads_of_rank"][i]:
                raise GkError(f"{self.where}: rank {i} holds kv heads {shown(r.get('heads'))}, the plan reads "
                              f"{p['heads_of_rank'][i]}")
            addr = [wire.integer(x.get("addr") if isinstance(x, dict) else None, f"rank {i} region address", 1)
                    for x in regs]
            size = [wire.integer(x.get("len"), f"rank {i} region length", 1) for x in regs]
            if any(n != self.num_blocks * p["block_len"] for n in size):
                raise GkError(f"{self.where}: rank {i}'s regions are not {self.num_blocks} blocks of {p['block_len']} bytes")
            self.regions.append(np.array(addr, dtype=np.uint64))

    def prefill(self, prompts: list[list[int]]) -> dict:
        """The prompts' first N-1 positions computed by the prefill (``check`` first): the round
        and each request's block ids, held to the run: N-1 positions computed, a full-group block
        for each block of them, sliding blocks among those."""
        deadline = self._deadline("prefill")
        wire.send(self.sock, {"op": "prefill", "prompts": prompts}, self.where, deadline)
        reply = wire.expect(self.sock, "prefilled", self.where, deadline)
        rnd = wire.integer(reply.get("round"), "round")
        asked = len(prompts[0]) - 1  # the N-1 rule: the decode computes the last prompt token itself
        n = wire.integer(reply.get("computed"), "computed positions", 0, len(prompts[0]))
        if n != asked:
            raise GkError(f"{self.where}: the prefill computed {n} positions of prompts of {len(prompts[0])} tokens; "
                          f"the run needs their first {asked} (N-1){NO_STEP}")
        blocks = -(-n // self.block)
        reqs = reply.get("requests")
        if not isinstance(reqs, list) or len(reqs) != len(prompts):
            raise GkError(f"{self.where}: {shown(reqs)} is not one block list a prompt")
        out = []
        for i, q in enumerate(reqs):
            full = q.get("full") if isinstance(q, dict) else None
            swa = q.get("swa") if isinstance(q, dict) else None
            if not isinstance(full, list) or not isinstance(swa, dict) or len(full) > len(prompts[0]) or len(swa) > len(full):
                raise GkError(f"{self.where}: a request's block ids are {shown(q)}")
            if len(full) != blocks:
                raise GkError(f"{self.where}: request {i} hands over {len(full)} full-attention blocks; its {n} computed "
                              f"positions fill {blocks} blocks of {self.block}{NO_STEP}")
            out.append({"full": [wire.integer(b, "a block id", 0, self.num_blocks) for b in full],
                        "swa": {wire.digits(k, "a logical block", 0, blocks): wire.integer(b, "a block id", 0, self.num_blocks)
                                for k, b in swa.items()}})
        return {"round": rnd, "computed": n, "requests": out}

    def release(self, rnd: int) -> None:
        deadline = self._deadline("release")
        wire.send(self.sock, {"op": "release", "round": rnd}, self.where, deadline)
        wire.expect(self.sock, "released", self.where, deadline)

    def close(self) -> None:
        self.sock.close()


# -- the pull -----------------------------------------------------------------------------------
def pull(build, session, prompts: list[list[int]], rows: torch.Tensor, spec: Prefill, quiet: bool = True) -> int:
    """Fill ``session``'s KV from the prefill engine for ``prompts`` (row b of the batch runs
    prompt ``rows[b]``); return the first position the session decodes (N-1)."""
    plan = plan_of(build, spec.tp, session.kv[0].layout.num_blocks)
    if spec.edit is not None:
        plan = spec.edit(plan)
    if spec.endpoint is None:  # an engine of its own for this pull, sized for these prompts
        blocks = pool_blocks(len(prompts), len(prompts[0]), plan["decode"]["block_size"], plan["window"])
        with prefill_process(prefill_args(build, spec.tp, blocks)) as (endpoint, _):
            return _pull(build, session, prompts, rows, spec, plan, endpoint, quiet)
    return _pull(build, session, prompts, rows, spec, plan, spec.endpoint, quiet)


def _pull(build, session, prompts, rows, spec: Prefill, plan: dict, endpoint, quiet: bool) -> int:
    from ..progress import note
    from ..reference import build_kv

    peer = Peer(endpoint, spec.timeout)
    try:
        peer.check(plan, build_kv(build.manifest))
        t = time.perf_counter()
        got = peer.prefill(prompts)
        n = got["computed"]
        session.steps.admit(n)
        pairs = _pairs(plan, session, got["requests"], rows, n)
        moved, reads = _read(plan, peer, session, pairs, n, spec.timeout)
        if plan["k_conversion"] is not None:
            _convert(plan, session, pairs)
        peer.release(got["round"])
        spec.stats = {"bytes": moved, "reads": reads, "seconds": time.perf_counter() - t, "computed": n}
        if not quiet:
            note(f"pulled {moved / 2**20:.2f} MiB of KV for {len(prompts)} prompts at N-1 = {n} positions from "
                 f"{plan['prefill']['tp']} prefill ranks over NIXL ({reads} descriptors, "
                 f"{spec.stats['seconds']:.1f} s)")
        return n
    finally:
        peer.close()


def _pairs(plan: dict, session, requests: list[dict], rows: torch.Tensor, n: int):
    """{(replica, row): block pairs by group} for every row of every DP replica."""
    ctl, out = session.steps, {}
    d = plan["decode"]
    for rep in range(ctl.dp):
        for j in range(ctl.rows):
            mine = ctl.block_ids(rep, j)
            theirs = requests[int(rows[rep * ctl.rows + j])]
            out[rep, j] = {g: block_pairs(g, n, d["block_size"], plan["window"], mine, theirs, plan["swa"]["truncate"])
                           for g in ("full", "swa")}
    return out


def _read(plan: dict, peer: Peer, session, pairs: dict, computed: int, timeout: float) -> tuple[int, int]:
    """Every READ of every decode rank, grouped by prefill rank, waited for together; none is
    posted unless they cover every block the run requires."""
    a = nixl.agent(f"gk-decode-{os.getpid()}-{next(_agents)}")
    tensors = [t for kv in session.kv for t in kv.allocations]
    reg = a.register_memory(tensors)
    try:
        names = []
        for i, r in enumerate(peer.ranks):
            md = wire.unb64(r.get("metadata"), f"rank {i}'s agent metadata")
            try:
                name = a.add_remote_agent(md)
            except Exception as e:  # noqa: BLE001 - the bindings' own error types
                raise GkError(f"{peer.where}: NIXL could not reach prefill rank {i}'s agent ({type(e).__name__}: "
                              f"{str(e)[:120]}); no decode step ran") from None
            name = name.decode(errors="replace") if isinstance(name, bytes) else name
            if name != r.get("agent"):
                raise GkError(f"{peer.where}: rank {i}'s metadata names agent {shown(name)}, not {shown(r.get('agent'))}")
            names.append(name)
        local: list[list[np.ndarray]] = [[] for _ in names]
        remote: list[list[np.ndarray]] = [[] for _ in names]
        tp = session.tp
        for r, kv in enumerate(session.kv):
            base = np.array([t.data_ptr() for t in kv.allocations], dtype=np.int64)
            size = np.array([t.numel() * t.element_size() for t in kv.allocations], dtype=np.int64)
            for j in range(session.steps.rows):
                short = shortfall(plan, r, pairs[r // tp, j], computed)
                if short:
                    raise GkError(f"the transfer plan falls short on decode rank {r}, row {j}: {short} after "
                                  f"{computed} prefilled positions; nothing was transferred{NO_STEP}")
                d = descriptors(plan, r, pairs[r // tp, j])
                if not len(d):
                    continue
                half, doff, prank, preg, poff, ln = d.T
                if (doff < 0).any() or (doff + ln > size[half]).any():
                    raise GkError(f"the plan reads past decode rank {r}'s KV tensors")
                if (prank < 0).any() or (prank >= len(names)).any() or (preg < 0).any() or \
                        (preg >= len(peer.regions[0])).any() or (poff < 0).any() or \
                        (poff + ln > peer.num_blocks * plan["prefill"]["block_len"]).any():
                    raise GkError(f"the plan reads past the prefill's registered regions (decode rank {r})")
                for p in np.unique(prank):
                    sel = prank == p
                    local[p].append(np.stack([base[half[sel]] + doff[sel], ln[sel]], axis=1))
                    remote[p].append(np.stack([peer.regions[p][preg[sel]].astype(np.int64) + poff[sel], ln[sel]], axis=1))
        reads = nixl.Reads(a)
        total = 0
        for p, name in enumerate(names):
            if local[p]:
                lr, rr = np.concatenate(local[p]), np.concatenate(remote[p])
                reads.post(name, lr, rr)
                total += len(lr)
        try:
            moved = reads.wait(timeout)
        except GkError as e:
            raise GkError(f"{e}; no decode step ran on the partial cache") from None
        for name in names:
            a.remove_remote_agent(name)
        return moved, total
    finally:
        a.deregister_memory(reg)


def _convert(plan: dict, session, pairs: dict) -> None:
    """Relay every received K block [kv, block, d] -> packed [kv, block/2, d, 2], in place, each
    block once (the plan's ``k_conversion``)."""
    for r, kv in enumerate(session.kv):
        by_entry: dict[int, list[np.ndarray]] = {}
        for j in range(session.steps.rows):
            for e, ids in received_k_blocks(plan, pairs[r // session.tp, j]):
                by_entry.setdefault(e, []).append(ids)
        raw, packed = kv.allocations[0], kv.arguments()["K_cache"]
        for e, ids in by_entry.items():
            idx = torch.from_numpy(np.unique(np.concatenate(ids)))
            packed[e, idx] = pack_block(raw[e, idx])
