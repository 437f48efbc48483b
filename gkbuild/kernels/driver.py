"""Drive a build's decode and tail the way a serving runtime does, through the twins.

The GK is decode-only: a prompt is fed one token a step (which fills the KV cache). Each step the
driver builds what a runtime passes to the kernel, per DP replica:

- block tables from one pool of ``num_blocks`` block ids per rank: full-attention layers keep a
  block for every position; sliding layers keep theirs only while inside the window and free them
  after (vLLM's hybrid manager), so the pool is reused and the trimmed SWA table is exercised;
- the trimmed SWA table (the window's blocks) with positions in its frame;
- absolute positions, the two KV update indices (flat slots), YaRN cos/sin (decode.rope host);
- the tokens: embedded here from the host-side table (decode.embedding host), or as the ids the
  kernel's fused embedding takes (the DP replica's tokens; vocab: local to the TP rank's rows, -1
  where another TP rank owns the id; hidden: global ids, plus the rank's rows ``embed_x_shard_ids``).

Then every rank runs the decode step (collectives emulated across ranks when the world is larger
than 1), gathers the batch for the tail, and the tail samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import GkError
from ..layout import hidden as hidden_layout
from ..layout.tail import owned_rows
from ..runtime import Build
from . import decode, rope, tail
from .kernel_inputs import embed_ids
from .collectives import Emulator, Single


@dataclass
class StepResult:
    logits: torch.Tensor  # [B, V] fp32 (the tail's emitted logits, vocab shards joined)
    tokens: torch.Tensor  # [B] sampled (greedy) tokens
    hiddens: list[torch.Tensor] | None  # per layer [B, H] fp32 in HF order


class _Blocks:
    """One DP replica's block ids from one pool of ``num_blocks``, as the KV form requires.

    stacked: every layer has its own entry, so a sequence's sliding and full layers share its
    block ids: one list a sequence, the sliding table is the window's suffix of it.
    paired: an entry's sliding and full layers draw DISJOINT blocks from one pool; sliding
    blocks are freed once the window has left them (vLLM's hybrid manager), so the pool is reused.
    """

    def __init__(self, rows: int, num_blocks: int, block: int, window: int, form: str):
        self.free = list(range(num_blocks - 1, -1, -1))
        self.full: list[list[int]] = [[] for _ in range(rows)]
        self.swa: list[dict[int, int]] = [{} for _ in range(rows)]  # logical block -> id
        self.block, self.window, self.shared = block, window, form == "stacked"
        self.size, self.peak = num_blocks, 0  # the most blocks held at once

    def _take(self) -> int:
        if not self.free:
            raise GkError("the build's KV budget (num_blocks) is too small for this run; lower the batch or steps")
        b = self.free.pop()
        self.peak = max(self.peak, self.size - len(self.free))
        return b

    def advance(self, row: int, pos: int) -> None:
        """Blocks for a token at ``pos``; free sliding blocks the window has left for good."""
        lb = pos // self.block
        if len(self.full[row]) <= lb:
            self.full[row].append(self._take())
        if lb not in self.swa[row]:
            self.swa[row][lb] = self.full[row][lb] if self.shared else self._take()
        first_visible = max(0, pos - self.window + 1)
        for b in [b for b in self.swa[row] if (b + 1) * self.block <= first_visible]:
            freed = self.swa[row].pop(b)
            if not self.shared:
                self.free.append(freed)


def blocks_needed(rows: int, positions: int, block: int, window: int, form: str) -> int:
    """The most blocks one DP replica's pool holds at once while its ``rows`` rows decode
    positions 0..positions-1 in step (``_Blocks`` taking and freeing them as a run does): in the
    paired form every sliding block comes on top of the full ones."""
    span = -(-positions // block)
    pool = _Blocks(rows, rows * (span + min(span, -(-window // block) + 2)), block, window, form)
    for pos in range(positions):
        for r in range(rows):
            pool.advance(r, pos)
    return pool.peak


def check_run(m: dict, kv, batch: int, max_len: int) -> None:
    """A run of ``batch`` sequences over ``max_len`` positions fits the build (manifest ``m``,
    KV layout ``kv``): its decode.max_context and its KV budget; else one line with the numbers.
    Cheap: callers check before any model work."""
    block, nbf = kv.block_size, m["scalars"]["full_table_blocks"]
    if max_len > nbf * block:
        raise GkError(f"{max_len} positions exceed the build's decode.max_context of {nbf * block}")
    rows = batch // m["topology"]["dp"]
    need = blocks_needed(rows, max_len, block, m["model"]["sliding_window"], kv.form)
    if need > kv.num_blocks:
        raise GkError(f"the build's KV budget is too small for this run: {rows} sequences a DP replica over {max_len} "
                      f"positions need {need} blocks of {block} in the {kv.form} form, the build has "
                      f"kv_cache.num_blocks {kv.num_blocks}; run fewer positions or rebuild with kv_cache.num_blocks "
                      f">= {need}")


class Controls:
    """What a runtime builds for each decode step, per DP replica: the block tables from each
    replica's pool, positions in both frames, the update slots and YaRN cos/sin (the twins' form;
    ``kernel_inputs`` turns it into the kernel's). One step of positions at a time, every row at the
    same position."""

    def __init__(self, m: dict, kv, batch: int, max_len: int):
        t, cfg = m["topology"], m["model"]
        self.dp, self.rows = t["dp"], batch // t["dp"]
        self.L, self.d, self.window = cfg["num_hidden_layers"], cfg["head_dim"], cfg["sliding_window"]
        self.rope = m["scalars"]["rope"]
        self.block = kv.block_size
        self.nbf, self.num_swa = m["scalars"]["full_table_blocks"], m["scalars"]["swa_table_blocks"]
        check_run(m, kv, batch, max_len)
        # only the blocks this run can reach: a row holds a full-attention block per block of
        # positions and at most the window's blocks (+2 at its edges) of sliding ones
        span = -(-max_len // self.block)
        self.num_blocks = min(kv.num_blocks, self.rows * (span + min(span, -(-self.window // self.block) + 2)))
        self.blocks = [_Blocks(self.rows, self.num_blocks, self.block, self.window, kv.form) for _ in range(self.dp)]
        self.pos = 0

    def admit(self, computed: int) -> None:
        """Take requests whose first ``computed`` positions were computed elsewhere (a DI
        prefill): their blocks are allocated as the steps would have allocated them and no step
        runs; the next step is at position ``computed``."""
        if self.pos:
            raise GkError("admit: this session has already run steps")
        if computed >= self.nbf * self.block:
            raise GkError(f"{computed} prefilled positions exceed the build's decode.max_context of "
                          f"{self.nbf * self.block}")
        for blocks in self.blocks:
            for pos in range(computed):  # position by position, every row: the order ``blocks_needed`` counts
                for r in range(self.rows):
                    blocks.advance(r, pos)
        self.pos = computed

    def block_ids(self, replica: int, row: int) -> dict:
        """A row's block ids: ``full`` one a logical block, ``swa`` {logical block: id} (the window's)."""
        b = self.blocks[replica]
        return {"full": list(b.full[row]), "swa": dict(b.swa[row])}

    def next(self) -> list[decode.Control]:
        """Every replica's control for the next position."""
        if self.pos >= self.nbf * self.block:
            raise GkError(f"position {self.pos} is past the build's decode.max_context of {self.nbf * self.block}")
        out = [self._control(rep) for rep in range(self.dp)]
        self.pos += 1
        return out

    def _control(self, replica: int) -> decode.Control:
        blocks, bs, pos = self.blocks[replica], self.block, self.pos
        rows = self.rows
        for r in range(rows):
            blocks.advance(r, pos)
        first_visible = max(0, pos - self.window + 1)
        start_block = first_visible // bs
        frame = start_block * bs
        full = torch.zeros(rows, self.nbf, dtype=torch.int64)
        swa = torch.zeros(rows, self.num_swa, dtype=torch.int64)
        for r in range(rows):
            full[r, :len(blocks.full[r])] = torch.tensor(blocks.full[r])
            for j in range(self.num_swa):
                if start_block + j in blocks.swa[r]:
                    swa[r, j] = blocks.swa[r][start_block + j]
        lb, off = divmod(pos, bs)
        upd = torch.tensor([blocks.full[r][lb] * bs + off for r in range(rows)])
        upd_swa = torch.tensor([blocks.swa[r][lb] * bs + off for r in range(rows)])
        positions = torch.full((rows,), pos, dtype=torch.int64)
        cos, sin = rope.tables(positions, self.d, self.rope) if self.rope["mode"] == "host" else (None, None)
        swa_start = torch.zeros(self.L, rows, dtype=torch.int64)
        swa_start[0::2] = first_visible - frame
        return decode.Control(cos=cos, sin=sin, block_table=full, block_table_swa=swa, pos=positions,
                              pos_swa=positions - frame, swa_start=swa_start, update_idx=upd, update_idx_swa=upd_swa)


class Session:
    """Decode steps of one build over a batch of sequences: through the torch twins (any topology,
    emulated), or (``engine="compiled"``) through the build's compiled programs (world size 1)."""

    def __init__(self, build: Build, batch: int, max_len: int, engine: str = "twin", compact_kv: bool = False,
                 kv: bool = True):
        """``kv=False``: no KV caches (a caller that keeps its own, as verify's replay does)."""
        m = build.manifest
        t = m["topology"]
        self.m, self.batch = m, batch
        self.world, self.tp, self.dp, self.vtp = t["world_size"], t["tp"], t["dp"], t["vtp"]
        if batch % self.world:
            raise GkError(f"batch {batch} is not a multiple of the {self.world} ranks")
        self.rows_attn = batch // self.dp
        self.t_shard = batch // self.world
        cfg = m["model"]
        self.V, self.H = cfg["vocab_size"], cfg["hidden_size"]
        kv = build.kv_layout()
        self.block = kv.block_size
        self.steps = Controls(m, kv, batch, max_len)
        hp = m["scalars"]["hidden_padded"]
        self.build = build
        self.tensors = [build.load_rank(r) for r in range(self.world)]
        self.host = build.load_host()
        self.embedding = m["layout"]["embedding"]
        self.memo = decode.ExpertCache()  # dequantized experts, every rank's
        # ``compact_kv``: only the blocks this run reaches (the twins take any number; what a
        # compiled program or the kernel is handed keeps the build's shapes)
        blocks = self.steps.num_blocks if compact_kv and engine == "twin" else None
        self.kv = [build.allocate_kv(blocks) for _ in range(self.world)] if kv else None
        self.scalars = [decode.Scalars.from_manifest(m, ep_rank=r) for r in range(self.world)]
        self.hops = len(t["hops"])
        meshes = t["meshes"]
        if self.world == 1:
            self.emulator = None
        else:
            groups = {"tp": meshes["tp_replica_group"], "ep": meshes["ep_replica_group"]}
            groups.update({("hop", i): mesh for i, mesh in enumerate(meshes["tail_hop_meshes"])})
            self.emulator = Emulator(groups)
        self.groups = t["a2a_batch_groups"]
        self.owned = [owned_rows(r % self.vtp, self.vtp, batch, t["hops"], self.groups)
                      for r in range(self.world)]
        self.k = m["layout"]["tail"]["k"]
        self.to_hf = torch.from_numpy(hidden_layout.sigma(hp))
        self.engine = engine
        if engine == "compiled":
            if self.world != 1:
                raise GkError("the compiled engine runs world-size-1 builds; verify a multi-rank build with the twins")
            self.programs = {a["name"]: (build.program(a["name"]), a["inputs"]) for a in m["compile"]["artifacts"]}

    def step(self, tokens: torch.Tensor, collect_hiddens: bool = False,
             guide: decode.RoutingGuide | None = None, on_layer=None) -> StepResult:
        """Feed one token per sequence; return the logits for the next one. ``on_layer(i)`` is
        told as rank 0 finishes each layer (progress)."""
        if tokens.shape != (self.batch,):
            raise GkError(f"expected {self.batch} tokens, got {tuple(tokens.shape)}")
        controls = self.controls = self.steps.next()
        greedy = torch.zeros(self.batch // self.vtp, 3)  # temperature 0: the argmax

        def rank_fn(r, comm):
            t, sc = self.tensors[r], self.scalars[r]
            x = self._embed(r, tokens, comm)
            hid = [] if collect_hiddens else None
            x = decode.step(t, x, self.kv[r], controls[r // self.tp], sc, comm, hid, guide, self.memo,
                            on_layer if r == 0 else None)
            everything = comm.all_gather(x, "ep")
            out = tail.step(everything, t["gamma"], t["lm_head_weight_t"], comm, self.hops, self.k, sc.eps,
                            sc.hidden_actual, params=greedy, emit_logits=True, batch_groups=self.groups)
            return out, ([comm.all_gather(h, "ep") for h in hid] if hid is not None else None)

        if self.engine == "compiled":
            results = [self._compiled(tokens, controls[0], greedy, collect_hiddens)]
            for i in range(self.steps.L if on_layer else 0):  # one program runs every layer
                on_layer(i)
        elif self.emulator is None:
            results = [rank_fn(0, Single())]
        else:
            results = self.emulator.run(rank_fn)
        self.build.release_pages("weights/expert-")  # the experts read this step, dequantized and done
        logits = torch.cat([results[v][0].logits for v in range(self.vtp)], dim=1)
        sampled = torch.empty(self.batch, dtype=torch.int64)
        for r in range(self.vtp):
            sampled[self.owned[r]] = results[r][0].tokens
        hiddens = None
        if collect_hiddens:
            hiddens = [h[:, self.to_hf.argsort()][:, :self.H] for h in results[0][1]]
        return StepResult(logits, sampled, hiddens)

    def _embed(self, r: int, tokens: torch.Tensor, comm) -> torch.Tensor:
        """Rank r's x [T_shard, Hp]: gathered here from the host table, or by the kernel's prologue."""
        placement = self.embedding["placement"]
        if placement == "host":
            return self.host["embed_tokens"][tokens[r * self.t_shard:(r + 1) * self.t_shard]].to(torch.float32)
        ids, rows = embed_ids(self.embedding, tokens, r, self.tp, self.dp)
        return decode.embed(self.tensors[r]["embed_weight"], torch.from_numpy(ids).long(), placement, comm,
                            None if rows is None else torch.from_numpy(rows).long())

    def _compiled(self, tokens, ctl: decode.Control, params, collect_hiddens: bool):
        """One step through the compiled decode and tail programs, arguments in signature order."""
        t, kv = self.tensors[0], self.kv[0]
        x = self._embed(0, tokens, None)
        program, inputs = self.programs["decode"]
        kv_args = kv.arguments()  # the buffers the program updates in place
        args = []
        for i in inputs:
            n = i["name"]
            if n == "x":
                args.append(x)
            elif i["kind"] == "control":
                args.append(getattr(ctl, n))
            elif i["kind"] == "weight":
                args.append(t[n])
            else:
                args.append(kv_args[n])
        x, hidden = program(*args)
        tail_program, _ = self.programs["tail"]
        tokens_out, values, indices, *logits = tail_program(x, params, t["gamma"], t["lm_head_weight_t"])
        out = tail.TailOut(tokens_out, values, indices, logits[0] if logits else None)
        return out, (list(hidden.unbind(0)) if collect_hiddens else None)
