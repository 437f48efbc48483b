"""Known token sequences through a build's twins, one layer at a time: verify's engine.

Verify feeds every position the reference's token (teacher forcing), so every token is known before
the first step and the twins can run layer-major: layer 0 at every position, then layer 1, and so
on. The arithmetic is the decode step's (``decode.attention``, ``decode.experts``, ``tail``) with
the controls a runtime builds for each position (``driver.Controls``), and a layer writes its K/V
in position order. A layer reads only the K/V it wrote itself (its own entry, or in the paired
form blocks no other layer holds at the same time), so the numbers are those of decoding step by
step, and one layer's entry a rank is enough: memory stays flat in layers. What the order buys:

- each layer's experts are decoded once for every position, and every local expert also runs on
  the golden's probe rows (``decode.Probe``): every expert shard is checked, routed or not;
- each layer also runs on the reference's own input (the ``local`` stream), so its departure is
  its own and not carried up from the layers below; the ``free`` stream runs on its own output.

Only the rows that hold a sequence compute (``live_rows``: one a sequence); the others keep their
place in every collective and every layout index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .. import parallel
from ..layout import hidden as hidden_layout
from . import decode, tail
from .ahead import ExpertsAhead
from .driver import Session

FREE, LOCAL = 0, 1


def _reachable(c: decode.Control, block: int) -> decode.Control:
    """A position's controls with the block tables cut to the blocks that position can see: the
    rest of a table is masked out in attention (same numbers, less arithmetic)."""
    full, swa = int(c.pos.max()) // block + 1, int(c.pos_swa.max()) // block + 1
    return dataclasses.replace(c, block_table=c.block_table[:, :full], block_table_swa=c.block_table_swa[:, :swa])


class Shared:
    """What emulated ranks compute alike within one layer, made once: a value is keyed by the
    memory it is made from, so ranks that map the same shard bytes (the 16 DP replicas of a TP
    shard, every EP rank's copy of the router) share it, and a rank with bytes of its own (a damaged
    shard) still gets its own."""

    def __init__(self):
        self._values: dict = {}

    def get(self, key, make):
        if key not in self._values:
            self._values[key] = make()
        return self._values[key]

    @staticmethod
    def key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype

    def float(self, t: torch.Tensor) -> torch.Tensor:
        return self.get(("float", self.key(t)), t.float)


class _Layer:
    """A stacked per-layer tensor seen at one layer, converted to float32 on first use, once for
    the ranks that share its bytes (attention indexes its weights by layer at every position)."""

    def __init__(self, stacked: torch.Tensor, i: int, shared: Shared):
        self.shape, self.i, self._stacked, self._shared = stacked.shape, i, stacked, shared

    def __getitem__(self, j: int) -> torch.Tensor:
        assert j == self.i, (j, self.i)
        return self._shared.float(self._stacked[j])


def _at_layer(t: dict, i: int, shared: Shared) -> dict:
    return {**t, **{k: _Layer(t[k], i, shared) for k in ("W_qkv", "bias_qkv", "sink")}}


def to_kernel(h: torch.Tensor, hp: int) -> torch.Tensor:
    """[..., H] HF hidden order -> [..., Hp] kernel lanes (zero pads)."""
    return torch.from_numpy(hidden_layout.to_kernel(h.cpu().numpy(), -1, hp))


@functools.cache
def _lanes(hp: int) -> torch.Tensor:
    """The kernel lane of each padded-HF hidden index."""
    return torch.from_numpy(hidden_layout.sigma(hp)).argsort()


def to_hf(x: torch.Tensor, H: int) -> torch.Tensor:
    """[..., Hp] kernel lanes -> [..., H] HF order, on the CPU."""
    return x[..., _lanes(x.shape[-1]).to(x.device)][..., :H].cpu()


def live_rows(batch: int, dp: int, sequences: int) -> list[int]:
    """The batch row of each sequence: spread over the DP replicas (sequence k in replica
    k * dp // sequences while there are fewer sequences than replicas, round-robin after), the row
    within a replica moving with the replica so that different TP ranks hold one. The other rows
    hold no sequence; their replicas keep their place in every collective but skip the arithmetic."""
    per = batch // dp
    out = []
    for k in range(sequences):
        d, j = (k * dp // sequences, 0) if sequences <= dp else (k % dp, k // dp)
        out.append(d * per + (j + d) % per)
    return out


@dataclass
class LayerOut:
    """One layer at every position, for the live rows (in ``Replay.rows`` order), HF hidden order."""

    hidden: torch.Tensor  # [S, T, R, H]: stream FREE (own input), then LOCAL (the reference's) if run
    taken: torch.Tensor  # [S, T, R] bool: routing took the reference's set at a tie
    departed: torch.Tensor  # [S, T, R] bool: our set differs where the reference's margin is clear
    probes: torch.Tensor  # [E, n, H]: every expert on the probe rows


class Replay:
    """A build's decode over known tokens, layer-major, on the ``Session``'s ranks and controls."""

    def __init__(self, session: Session, rows: list[int], positions: int, device: str = "cpu"):
        """``rows``: the batch row of each sequence (``live_rows``)."""
        s = self.s = session
        self.rows = torch.tensor(rows)
        self.T, self.dev = positions, torch.device(device)
        self.world, self.tp, self.t_shard = s.world, s.tp, s.t_shard
        self.hp, self.L = s.m["scalars"]["hidden_padded"], s.m["model"]["num_hidden_layers"]
        # every position's controls, as a runtime would build them step by step
        self.controls = [[_reachable(c, s.block).to(self.dev) for c in s.steps.next()] for _ in range(positions)]
        if self.dev.type != "cpu":
            s.tensors = [{k: v.to(self.dev) for k, v in t.items()} for t in s.tensors]
        # one layer's KV entry a rank and stream, emptied for each layer: a layer reads only what it
        # wrote itself at earlier positions, so memory stays flat in layers
        self.kv = [[s.build.allocate_kv(s.steps.num_blocks, one_layer=True) for _ in range(self.world)]
                   for _ in (FREE, LOCAL)]
        for kvs in self.kv:
            for kv in kvs:
                kv.allocations = [a.to(self.dev) for a in kv.allocations]
        live = torch.zeros(s.batch, dtype=torch.bool)
        live[self.rows] = True
        per = s.rows_attn
        self.live_in_replica = [torch.nonzero(live[d * per:(d + 1) * per]).flatten().to(self.dev)
                                for d in range(s.dp)]
        self.x = [[torch.zeros(positions, self.t_shard, self.hp, device=self.dev)] for _ in range(self.world)]
        self.ahead: ExpertsAhead | None = None

    @contextlib.contextmanager
    def experts_ahead(self, budget: int):
        """While inside, every rank's experts of every layer are read on the host's cores ahead of
        their use (``kernels.ahead``), at most ``budget`` bytes of them at once (at least two
        experts); the readers are stopped on leaving."""
        s = self.s
        E_L = s.scalars[0].experts_per_rank
        sizes = decode.buffer_sizes(s.tensors[0])
        rank = {sc.ep_rank: r for r, sc in enumerate(s.scalars)}  # experts are asked for by EP rank

        def read(ep: int, i: int, e: int, out: tuple) -> decode.DecodedExpert:
            s.build.need_layer(i)  # read ahead of the layer's turn: a store's shards are fetched a layer at a time
            return decode.DecodedExpert(s.tensors[rank[ep]], i, e, s.scalars[rank[ep]], out)

        guess = [(ep, e) for ep in rank for e in range(E_L)]
        with ExpertsAhead(read, sizes, guess, self.L, max(2, budget // (4 * sum(sizes))), parallel.WORKERS) as ahead:
            self.ahead = ahead
            try:
                yield
            finally:
                self.ahead = None

    # -- layout helpers ------------------------------------------------------------------------
    def to_kernel(self, h: torch.Tensor) -> torch.Tensor:
        return to_kernel(h, self.hp).to(self.dev)

    def to_hf(self, x: torch.Tensor) -> torch.Tensor:
        return to_hf(x, self.s.H)

    def _batch(self, per_row: torch.Tensor, fill=0.0) -> torch.Tensor:
        """[T, R, ...] for the live rows -> [T, B, ...] for the batch (``fill`` elsewhere)."""
        out = torch.full((per_row.shape[0], self.s.batch, *per_row.shape[2:]), fill, dtype=per_row.dtype,
                         device=per_row.device)
        out[:, self.rows.to(per_row.device)] = per_row
        return out

    def _gather(self, S: int) -> torch.Tensor:
        """Every rank's x -> [S, T, R, Hp] of the live rows."""
        x = torch.stack([torch.stack(self.x[r][:S]) for r in range(self.world)], dim=2)  # [S, T, W, t_shard, Hp]
        return x.reshape(S, self.T, self.s.batch, self.hp)[:, :, self.rows.to(self.dev)]

    # -- the run -------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> None:
        """tokens [T, R] of the live rows: x before layer 0 (the runtime's or the kernel's embedding)."""
        full = self._batch(tokens, 0).to(torch.int64).cpu()

        def fn(r, comm):
            for t in range(self.T):
                self.x[r][FREE][t] = self.s._embed(r, full[t], comm).to(self.dev)

        self._run(fn)

    def layer(self, i: int, reference_in: torch.Tensor | None, routing: torch.Tensor, gap: torch.Tensor,
              probe: torch.Tensor, tie: float, advance: Callable[[int, str], None] = lambda n, w="": None) -> LayerOut:
        """Layer i at every position. ``reference_in`` [T, R, H]: the reference's input to layer i
        (the LOCAL stream; None at layer 0, whose input is the embedding either way);
        ``routing`` [T, R, k] and ``gap`` [T, R]: the reference's choices and margins;
        ``probe`` [n, H]: the rows every expert runs on."""
        self.s.build.need_layer(i)
        S = 1 if reference_in is None else 2
        if S == 2:
            ref = self._batch(self.to_kernel(reference_in))  # [T, B, Hp]
            for r in range(self.world):
                self.x[r][1:] = [ref[:, r * self.t_shard:(r + 1) * self.t_shard].clone()]
        sel = self._moe_rows(S)
        experts = torch.zeros(i + 1, len(sel), routing.shape[-1], dtype=torch.int64)
        gaps = torch.zeros(i + 1, len(sel))
        experts[i] = routing[:, :, None].expand(-1, -1, S, -1).reshape(len(sel), -1)
        gaps[i] = gap[:, :, None].expand(-1, -1, S).reshape(-1)
        guide = decode.RoutingGuide(experts, gaps, tie)  # every EP rank routes with it; rank 0 records
        probe_k = self.to_kernel(probe)
        probes: dict = {}
        shared = Shared()

        def fn(r, comm):
            t, sc = _at_layer(self.s.tensors[r], i, shared), self.s.scalars[r]
            replica = r // self.tp
            lr = self.live_in_replica[replica]
            if len(lr):  # a replica without a live row only takes part in the collectives
                ln1 = shared.float(t["input_layernorm_weight"][i])
                w_out, b_out = shared.float(t["W_out"][i]), shared.float(t["bias_out"][i])
            for s in range(S):
                kv = self.kv[s][r]
                for a in kv.allocations:
                    a.zero_()
                # the layer's input is known at every position, so the replica's rows of every position
                # are gathered, normed and projected at once, and their attention output projected and
                # reduce-scattered at once; only attention over the cache runs position by position
                X = comm.all_gather(self.x[r][s].transpose(0, 1), "tp")  # [B_attn, T, Hp]
                A = torch.zeros(0, self.T, self.hp, device=self.dev)  # the live rows' output: the others add 0
                if len(lr):
                    qkv = decode.qkv(t, i, decode.rms_norm(X[lr], ln1, sc.eps, sc.hidden_actual))  # [n, T, qkv]
                    heads = []
                    for pos in range(self.T):
                        heads.append(decode.attention(t, i, qkv[:, pos], kv.k(0), kv.v(0),
                                                      self.controls[pos][replica].select(lr), sc))
                        if r == 0:
                            advance(1, f"layer {i + 1}/{self.L}, position {pos + 1}/{self.T}")
                    A = torch.stack(heads, 1) @ w_out + b_out
                elif r == 0:
                    advance(self.T, f"layer {i + 1}/{self.L}")
                mine = comm.reduce_scatter_rows(lr, A, X.shape[0], "tp")  # [t_shard, T, Hp]
                self.x[r][s] = self.x[r][s] + mine.transpose(0, 1)
            M = comm.all_gather(torch.cat([self.x[r][s].reshape(-1, self.hp) for s in range(S)]), "ep")
            gamma = t["post_attn_layernorm_weight"][i]
            moe_in = ("moe input", id(M), Shared.key(gamma), sc.eps, sc.hidden_actual)
            xn = shared.get(moe_in, lambda: decode.rms_norm(M[sel], shared.float(gamma), sc.eps, sc.hidden_actual))
            w, b = t["router_weights"][i], t["router_bias"][i]
            logits = shared.get(("router", moe_in, Shared.key(w), Shared.key(b)),  # this rank's own input and router
                                lambda: decode.router(xn, shared.float(w), shared.float(b)))
            probe_ = decode.Probe(probe_k)
            out = decode.experts(t, i, xn, sc, guide, memo=self.ahead, probe=probe_, logits=logits)
            del xn
            hit = torch.nonzero(out.abs().sum(-1)).flatten()  # the rows this rank's experts add to
            values = out[hit]
            del out  # every rank waits in the collective below: each holds only the rows it adds to
            mine = comm.reduce_scatter_rows(sel[hit], values, M.shape[0], "ep").reshape(S, self.T, self.t_shard, -1)
            for s in range(S):
                self.x[r][s] = self.x[r][s] + mine[s]
            probes.update(probe_.out)
            advance(sc.experts_per_rank, f"layer {i + 1}/{self.L}, experts")

        self._run(fn)
        self.s.build.release_pages("weights/")  # this layer's pages are done with
        self.s.build.done_layer(i)
        x = self._gather(S)
        shape = (self.T, len(self.rows), S)
        return LayerOut(self.to_hf(x), guide.taken[i].reshape(shape).permute(2, 0, 1),
                        guide.departed[i].reshape(shape).permute(2, 0, 1),
                        self.to_hf(torch.stack([probes[e] for e in sorted(probes)])))

    def _moe_rows(self, S: int) -> torch.Tensor:
        """Where the live rows sit in the EP-gathered MoE input ([W, S, T, t_shard] flattened), in
        [T, R, S] order."""
        w, k = self.rows // self.t_shard, self.rows % self.t_shard
        s, t = torch.arange(S), torch.arange(self.T)
        idx = (w[None, :, None] * S * self.T * self.t_shard + s[None, None, :] * self.T * self.t_shard
               + t[:, None, None] * self.t_shard + k[None, :, None])  # [T, R, S]
        return idx.reshape(-1).to(self.dev)

    def tail(self, advance: Callable[[int, str], None] = lambda n, w="": None) -> torch.Tensor:
        """The tail at every position after the last layer: the emitted logits [T, R, V] of the
        live rows (each vocab rank's slice joined); every rank also exchanges its rows and takes the
        top-k of the live rows it owns."""
        s = self.s
        live = self.rows.to(self.dev)
        greedy = torch.zeros(s.batch // s.vtp, 3, device=self.dev)
        logits = {}

        def fn(r, comm):
            t, sc = s.tensors[r], s.scalars[r]
            h = torch.stack([comm.all_gather(self.x[r][FREE][pos], "ep")[live] for pos in range(self.T)])
            mine = tail.lm_head(h.reshape(-1, self.hp), t["gamma"], t["lm_head_weight_t"], sc.eps,
                                sc.hidden_actual, tail.by_columns).reshape(self.T, len(live), -1)
            owned = torch.tensor(s.owned[r], device=self.dev)
            owned_live = torch.nonzero(torch.isin(owned, live)).flatten()
            for pos in range(self.T):
                full = self._batch(mine[pos:pos + 1])[0].to(torch.bfloat16)
                rows = tail.exchange(full, comm, s.hops, s.groups)[owned_live].to(torch.float32)
                values, indices = tail.stable_topk(rows, s.k)
                tail.sample(values, indices, greedy[owned_live])
            if r < s.vtp:
                logits[r] = mine.cpu()
            if r == 0:
                advance(self.T, "tail")

        self._run(fn)
        s.build.release_pages("weights/")
        return torch.cat([logits[v] for v in range(s.vtp)], dim=-1)

    def _run(self, fn) -> None:
        if self.s.emulator is None:
            from .collectives import Single

            fn(0, Single())
        else:
            self.s.emulator.run(fn)


def probe_experts(session: Session, i: int, probe: torch.Tensor) -> torch.Tensor:
    """Every expert of layer i, on every rank, on the probe rows [n, H] (HF order) through the
    twin's expert path: [E, n, H] (for engines that run whole steps)."""
    hp = session.m["scalars"]["hidden_padded"]
    px, out = to_kernel(probe, hp), {}
    for t, sc in zip(session.tensors, session.scalars):
        pr = decode.Probe(px.to(t["router_weights"].device))
        decode.experts(t, i, torch.zeros(0, hp, device=pr.x.device), sc, probe=pr)
        out.update(pr.out)
    session.build.release_pages("weights/expert-")
    return to_hf(torch.stack([out[e] for e in sorted(out)]), session.H)


def tail_on(session: Session, final_hidden: torch.Tensor, final_norm: torch.Tensor, norm_error) -> tuple:
    """The tail's parts on the reference's numbers, on every rank: its final norm on the reference's
    last hidden state [N, H] (``norm_error`` of it, the worst over ranks: [N]), and its lm_head on the
    reference's norm output [N, H] (the vocab ranks' logits joined: [N, V])."""
    hp = session.m["scalars"]["hidden_padded"]
    h, n = to_kernel(final_hidden, hp), to_kernel(final_norm, hp)
    worst, logits = torch.zeros(len(h)), []
    for r, (t, sc) in enumerate(zip(session.tensors, session.scalars)):
        dev = t["gamma"].device
        normed = decode.rms_norm(h.to(dev), t["gamma"].float(), sc.eps, sc.hidden_actual)
        worst = torch.maximum(worst, norm_error(to_hf(normed, session.H)))
        if r < session.vtp:
            logits.append(tail.by_columns(n.to(dev), t["lm_head_weight_t"]).cpu())
    session.build.release_pages("weights/")
    return worst, torch.cat(logits, dim=-1)
