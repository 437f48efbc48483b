"""A DI prefill engine: its own process, its own NIXL agents, the KV layout of seed 000's per-layer engine.

    python -m gkbuild.di.prefill --checkpoint DIR --kv FORMAT [--k-scale S --v-scale S]
        --block-size B --tp N --num-blocks NB [--port P]

Each of the ``--tp`` prefill ranks holds ``kv_heads / tp`` kv heads in ceil(L/2) buffers
``[2, NB, kv_p, B, d]`` (layer pair j: sliding layer 2j, full layer 2j+1; K half then V half),
registered with that rank's NIXL agent, one region a half. A request's prompt of N tokens is run
through the streamed reference (``gkbuild.reference``) at N-1 tokens (the SWA N-1 rule); its K
(after RoPE) and V are stored in the KV format (bf16, or FP8 at the scales, as the decode build
stores them), K token-major ``[kv_p, B, d]``. Block ids come from one pool: the full group one a
block of the N-1 positions, the sliding group (disjoint ids) only its last ceil(W/B)+1 blocks, as
vLLM's connector hands them over (``get_sw_clipped_blocks``).

The side channel listens on 127.0.0.1 (``wire``): ``hello`` (the engine and its ranks' agent
metadata and region addresses), ``prefill`` (prompts -> block ids), ``release`` (a round's blocks
back to the pool), ``shutdown``. It prints ``READY <port>`` when it listens, and exits when its
stdin closes (its parent is gone).
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import GkError
from ..recipe import SCALE_RULES
from ..reference import KV_FORMATS, KvFormat
from . import nixl, wire
from .plan import HALVES, prefill_heads

MAX_PROMPTS = 4096
MAX_PROMPT_LEN = 1 << 20


@dataclass(frozen=True)
class Engine:
    """What a prefill engine is: the model's attention shape, its KV format and layout, its pool."""

    checkpoint: Path
    fmt: KvFormat
    block_size: int
    tp: int
    num_blocks: int
    num_layers: int
    kv_heads: int
    head_dim: int
    window: int
    vocab_size: int
    scale_rule: str = "round_up"  # a dense source's experts quantized so (the build's rule)

    @property
    def kv_per_rank(self) -> int:
        return len(prefill_heads(0, self.tp, self.kv_heads))

    @property
    def buffers(self) -> int:
        return -(-self.num_layers // 2)

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(self.fmt.dtype, torch.float8_e4m3fn)

    @property
    def block_len(self) -> int:
        return self.kv_per_rank * self.block_size * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def describe(self) -> dict:
        return {"tp": self.tp, "kv": self.fmt.to_meta(), "block_size": self.block_size, "num_blocks": self.num_blocks,
                "num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "window": self.window, "block_len": self.block_len, "buffers": self.buffers,
                "layout": "per_buffer"}


class Rank:
    """One prefill rank: its buffers, registered with its own agent."""

    def __init__(self, engine: Engine, rank: int, tag: str):
        e = engine
        self.heads = prefill_heads(rank, e.tp, e.kv_heads)
        self.buffers = [torch.zeros(2, e.num_blocks, len(self.heads), e.block_size, e.head_dim, dtype=e.dtype)
                        for _ in range(e.buffers)]
        self.agent = nixl.agent(f"gk-prefill-{tag}-{rank}")
        self.halves = [b[h] for b in self.buffers for h in range(len(HALVES))]  # region k = 2j + half
        try:
            self.agent.register_memory(self.halves)
        except Exception as ex:  # noqa: BLE001
            raise GkError(f"prefill rank {rank}: NIXL could not register its KV buffers: {str(ex)[:200]}") from None

    def hello(self, rank: int) -> dict:
        return {"rank": rank, "agent": self.agent.name, "heads": self.heads,
                "metadata": wire.b64(self.agent.get_agent_metadata()),
                "regions": [{"index": k, "addr": t.data_ptr(), "len": t.numel() * t.element_size()}
                            for k, t in enumerate(self.halves)]}


class Server:
    def __init__(self, engine: Engine):
        self.engine = engine
        tag = f"{os.getpid()}"
        self.ranks = [Rank(engine, p, tag) for p in range(engine.tp)]
        self.free = list(range(engine.num_blocks - 1, -1, -1))
        self.rounds: dict[int, list[int]] = {}
        self.next_round = 0
        self.cache: dict[tuple, tuple[list, list]] = {}  # prompts -> (K, V) of every layer, encoded

    # -- requests -----------------------------------------------------------------------------
    def prefill(self, msg: dict) -> dict:
        e = self.engine
        prompts = msg.get("prompts")
        if not isinstance(prompts, list) or not 0 < len(prompts) <= MAX_PROMPTS or \
                not all(isinstance(p, list) and 0 < len(p) <= MAX_PROMPT_LEN for p in prompts) or \
                len({len(p) for p in prompts}) != 1:
            raise GkError("prefill: prompts must be 1..4096 token lists of one nonzero length")
        for p in prompts:
            for t in p:
                wire.integer(t, "a token id", 0, e.vocab_size)
        n = len(prompts[0]) - 1  # the N-1 rule: the decode computes the last prompt token itself
        key = tuple(tuple(p[:n]) for p in prompts)
        if n and key not in self.cache:
            self.cache = {key: self._compute([list(p) for p in key])}  # the last prompts' K/V, for reruns
        need = len(prompts) * (self._full_blocks(n) + len(self._window(n)))
        if need > len(self.free):
            raise GkError(f"prefill: {need} blocks needed, {len(self.free)} of the pool's {e.num_blocks} free "
                          f"(start it with a larger --num-blocks)")
        requests, taken = [], []
        for r in range(len(prompts)):
            full = [self.free.pop() for _ in range(self._full_blocks(n))]
            swa = {lb: self.free.pop() for lb in self._window(n)}
            taken += full + list(swa.values())
            if n:
                self._write(self.cache[key], r, n, full, swa)
            requests.append({"full": full, "swa": {str(k): v for k, v in swa.items()}})
        rnd = self.next_round
        self.next_round += 1
        self.rounds[rnd] = taken
        return {"op": "prefilled", "round": rnd, "computed": n, "requests": requests}

    def release(self, msg: dict) -> dict:
        rnd = wire.integer(msg.get("round"), "a round")
        ids = self.rounds.pop(rnd, None)
        if ids is None:
            raise GkError(f"release: no round {rnd}")
        self.free += ids
        return {"op": "released"}

    def _full_blocks(self, n: int) -> int:
        return -(-n // self.engine.block_size)

    def _window(self, n: int) -> range:
        """The sliding group's blocks the engine still holds after n positions: the last
        ceil(W/B)+1 (vLLM's ``blocks_per_sw``; the rest were freed as the window moved on)."""
        nb = self._full_blocks(n)
        keep = -(-self.engine.window // self.engine.block_size) + 1
        return range(max(0, nb - keep), nb)

    def _compute(self, prompts: list[list[int]]) -> tuple[list, list]:
        """The reference over the prompts; every layer's K and V encoded in the KV format."""
        from ..reference import run

        e = self.engine
        ks: list = [None] * e.num_layers
        vs: list = [None] * e.num_layers

        def keep(layer, k, v):
            ks[layer] = e.fmt.encode(k, e.fmt.k_scale)
            vs[layer] = e.fmt.encode(v, e.fmt.v_scale)

        run(e.checkpoint, prompts, 0, e.fmt, on_kv=keep, rule=e.scale_rule)
        return ks, vs

    def _write(self, kv: tuple[list, list], r: int, n: int, full: list[int], swa: dict[int, int]) -> None:
        """Request r's K/V into every rank's buffers: layer i in buffer i // 2, at its group's
        block ids, token-major; sliding layers only in the window's blocks."""
        e = self.engine
        ks, vs = kv
        pos = torch.arange(n)
        for i in range(e.num_layers):
            if i % 2 == 0:
                keep = torch.tensor([(int(t) // e.block_size) in swa for t in pos])
                p = pos[keep]
                ids = torch.tensor([swa[int(t) // e.block_size] for t in p], dtype=torch.long)
            else:
                p = pos
                ids = torch.tensor([full[int(t) // e.block_size] for t in p], dtype=torch.long)
            off = p % e.block_size
            for rank in self.ranks:
                buf = rank.buffers[i // 2]
                hs = rank.heads
                for h, src in ((0, ks), (1, vs)):
                    buf[h][ids, :, off, :] = src[i][r][hs][:, p].permute(1, 0, 2).to(buf.dtype)

    # -- the side channel ---------------------------------------------------------------------
    def hello(self) -> dict:
        return {"op": "hello", "version": wire.VERSION, "engine": self.engine.describe(),
                "ranks": [rk.hello(p) for p, rk in enumerate(self.ranks)]}

    def serve(self, listener: socket.socket) -> None:
        """Connections one after the other until ``shutdown``; a connection's rounds go back to
        the pool when it closes. While a round is out, the agents are progressed between
        messages: its blocks are being read."""
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(None)
                mine: set[int] = set()
                try:
                    if not self._conversation(conn, mine):
                        return
                finally:
                    for rnd in mine & set(self.rounds):
                        self.free += self.rounds.pop(rnd)

    def _conversation(self, conn: socket.socket, mine: set[int]) -> bool:
        """Messages of one connection until the peer leaves (True) or says ``shutdown`` (False)."""
        handlers = {"hello": lambda m: self.hello(), "prefill": self.prefill, "release": self.release}
        agents = [rk.agent for rk in self.ranks]
        while True:
            while mine & set(self.rounds) and not select.select([conn], [], [], 0.001)[0]:
                nixl.progress(agents)
            try:
                msg = wire.recv(conn, "prefill side channel")
            except GkError:
                return True  # the peer left
            if msg["op"] == "shutdown":
                _answer(conn, {"op": "bye"})
                return False
            try:
                handler = handlers.get(msg["op"])
                if handler is None:
                    raise GkError(f"unknown message {msg['op'][:40]!r}")
                reply = handler(msg)
            except GkError as ex:
                reply = {"op": "error", "message": f"prefill: {ex}"}
            if reply["op"] == "prefilled":
                mine.add(reply["round"])
            if not _answer(conn, reply):
                return True  # the peer left


def _answer(conn: socket.socket, msg: dict) -> bool:
    """Send ``msg``; False where the peer has gone (a decode side that left mid-exchange does not
    end the engine)."""
    try:
        wire.send(conn, msg, "prefill side channel")
        return True
    except GkError:
        return False


def engine_from_args(a: argparse.Namespace) -> Engine:
    from ..checkpoint.reader import Checkpoint

    fmt = KvFormat(a.kv, a.k_scale, a.v_scale)
    ck = Checkpoint.open(a.checkpoint)
    cfg = ck.config
    ck.close()
    if cfg.num_key_value_heads % a.tp and a.tp % cfg.num_key_value_heads:
        raise GkError(f"--tp {a.tp}: {cfg.num_key_value_heads} kv heads do not split over it")
    return Engine(Path(a.checkpoint), fmt, a.block_size, a.tp, a.num_blocks, cfg.num_hidden_layers,
                  cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window, cfg.vocab_size, a.scale_rule)


def _exit_with_parent() -> None:
    """Exit as soon as stdin closes: the process that started this one is gone."""
    def watch():
        while os.read(0, 1 << 12):  # the raw fd: a buffered stdin's lock would stall shutdown
            pass
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gkbuild.di.prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder (HF layout)")
    ap.add_argument("--kv", required=True, choices=KV_FORMATS, help="KV format the engine stores")
    ap.add_argument("--k-scale", type=float, default=1.0, help="FP8 K dequant scale")
    ap.add_argument("--v-scale", type=float, default=1.0, help="FP8 V dequant scale")
    ap.add_argument("--scale-rule", choices=SCALE_RULES, default="round_up",
                    help="how a dense source's experts are quantized (the build's recipe)")
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--tp", type=int, default=4, help="prefill ranks (kv heads split over them)")
    ap.add_argument("--num-blocks", type=int, required=True, help="blocks in each rank's pool")
    ap.add_argument("--port", type=int, default=0, help="side-channel port on 127.0.0.1 (0: any free one)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    _exit_with_parent()
    try:
        if not 0 < a.block_size <= 1 << 16 or not 0 < a.tp <= 1 << 10 or not 0 < a.num_blocks <= 1 << 24:
            raise GkError("--block-size, --tp and --num-blocks must be positive and bounded")
        server = Server(engine_from_args(a))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", a.port))
        listener.listen(4)
    except GkError as e:
        print(f"gkbuild prefill: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"READY {listener.getsockname()[1]}", flush=True)
    os.dup2(2, 1)  # nobody reads stdout from here on: what is written there (NIXL's log) goes to stderr
    with listener:
        server.serve(listener)


if __name__ == "__main__":
    main()
