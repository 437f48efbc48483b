"""The GK decode step for one rank, in plain PyTorch, reading the build's shard layouts.

Before the layers, where the kernel embeds (decode.embedding vocab | hidden), its fused-embedding
prologue (``embed``) makes x from token ids; otherwise the runtime passes x. Per layer i (the
giga-kernel's layer body, CONTRACT.md section 2):

    X   = all_gather_tp(x)                              this DP replica's tokens
    a   = attention(qkv(rmsnorm(X))) @ W_out[i] + bias_out   QKV fused, YaRN RoPE, paged KV with
                                                         sinks; sliding layers read the trimmed
                                                         block table in window-frame positions
    x   = x + reduce_scatter_tp(a)
    M   = all_gather_ep(x)                              every token
    m   = sum over this rank's experts e of affinity_e * expert_e(rmsnorm(M))
    x   = x + reduce_scatter_ep(m)

The step takes the rank's tensors exactly as the shards hold them (MX tiles are dequantized inside
the step, as the kernel does on chip) and is written to trace: ``torch.export`` captures it whole
for the compiled artifacts (``gkbuild.compile``). Activations are float32 (the weights are exact in
it); RMSNorm divides by the real hidden size (the pad lanes are zero); the new token's K/V is
written in place into the rank's paged buffers (packed FP8 K through ``layout.kv.write_k``). FP8
KV follows the nki twin: stored = clamp(value * quantize multiplier) in the format, the active
token attends at that scale unrounded, the dequant scales live in softmax_scale and W_out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import parallel
from ..layout import hidden, kv as kvlayout
from . import mx
from .rope import apply as rope_apply, fused_tables

FP8_MAX = {"fp8_e4m3": 240.0, "fp8_e4m3fn": 448.0}
# Packed FP8 K is written through an IEEE e4m3 view on every target (attention_tkg
# ``_k_update_fp8_packed``: ``reinterpret_cast(nl.float8_e4m3)`` of the row, in A and F): at most 240
# survives, whatever the cache's own format. The active token still attends at the format's max.
PACKED_K_MAX = 240.0


@dataclass(frozen=True)
class Scalars:
    """What the kernel takes as compile-time scalars, for one rank."""

    num_layers: int
    eps: float
    hidden_actual: int
    hidden_padded: int
    top_k: int
    softmax_scale: float
    gate_clamp_upper_limit: float
    up_clamp_upper_limit: float
    up_clamp_lower_limit: float
    k_scale: float | None  # quantize multipliers (1 / dequant scale), FP8 KV only
    v_scale: float | None
    kv_dtype: str
    packed: bool
    block_size: int
    experts: str  # mxfp4 | bf16
    ep_rank: int
    experts_per_rank: int
    rope: str = "host"  # host: cos/sin are inputs; fused: from inv_freq and the positions
    rope_concentration: float | None = None

    @classmethod
    def of(cls, scalars: dict, kv_dtype: str, packed: bool, block_size: int, experts: str, experts_per_rank: int,
           ep_rank: int) -> "Scalars":
        s = scalars
        return cls(num_layers=s["num_layers"], eps=s["eps"], hidden_actual=s["hidden_actual"],
                   hidden_padded=s["hidden_padded"], top_k=s["top_k"], softmax_scale=s["softmax_scale"],
                   gate_clamp_upper_limit=s["gate_clamp_upper_limit"], up_clamp_upper_limit=s["up_clamp_upper_limit"],
                   up_clamp_lower_limit=s["up_clamp_lower_limit"], k_scale=s["k_scale"], v_scale=s["v_scale"],
                   kv_dtype=kv_dtype, packed=packed, block_size=block_size, experts=experts, ep_rank=ep_rank,
                   experts_per_rank=experts_per_rank, rope=s["rope"]["mode"],
                   rope_concentration=s["rope_concentration"])

    @classmethod
    def from_manifest(cls, m: dict, ep_rank: int) -> "Scalars":
        kv = m["layout"]["kv"]
        return cls.of(m["scalars"], kv["dtype"], kv["packed"], kv["block_size"], m["recipe"]["resolved"]["experts"],
                      m["model"]["num_local_experts"] // m["topology"]["ep"], ep_rank)

    @classmethod
    def from_plan(cls, plan, ep_rank: int) -> "Scalars":
        return cls.of(plan.scalars, plan.kv.dtype, plan.kv.packed, plan.kv.block_size, plan.recipe.experts,
                      plan.dims.E_L, ep_rank)


@dataclass
class Control:
    """Layer-invariant inputs for one step of one DP replica (B_attn rows)."""

    cos: torch.Tensor | None  # [B, d/2]; None with fused RoPE (the kernel computes them)
    sin: torch.Tensor | None
    block_table: torch.Tensor  # [B, nbf] full-attention layers (odd)
    block_table_swa: torch.Tensor  # [B, num_swa] trimmed, sliding layers (even)
    pos: torch.Tensor  # [B] absolute position of the new token
    pos_swa: torch.Tensor  # [B] its position in the trimmed window's frame
    swa_start: torch.Tensor  # [L, B] first visible frame position (0 on full layers)
    update_idx: torch.Tensor  # [B] flat slot block*block_size + offset; -1: inactive row
    update_idx_swa: torch.Tensor

    FIELDS = ("cos", "sin", "block_table", "block_table_swa", "pos", "pos_swa", "swa_start", "update_idx",
              "update_idx_swa")

    def select(self, rows: torch.Tensor) -> "Control":
        """The controls of some rows only (``swa_start`` keeps its layer axis)."""
        pick = {n: getattr(self, n) for n in self.FIELDS}
        return Control(**{n: None if v is None else (v[:, rows] if n == "swa_start" else v[rows])
                          for n, v in pick.items()})

    def to(self, device) -> "Control":
        return Control(**{n: None if getattr(self, n) is None else getattr(self, n).to(device) for n in self.FIELDS})


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, hidden_actual: int) -> torch.Tensor:
    """RMSNorm over the real hidden size: the pad lanes are zero and stay out of the mean."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / hidden_actual + eps) * gamma


def qkv(t: dict, i: int, X: torch.Tensor) -> torch.Tensor:
    """The fused QKV projection of normed rows X [..., Hp] for this rank's heads: [..., qkv]."""
    return X @ t["W_qkv"][i].float() + t["bias_qkv"][i].float()


def attention(t: dict, i: int, qkv: torch.Tensor, K_half, V_half, ctl: Control, sc: Scalars) -> torch.Tensor:
    """One layer's attention for this rank's heads over the replica's rows, from their projection
    ``qkv`` [B, qkv]: [B, q_l*d]."""
    q_l = t["sink"].shape[1]
    d = t["W_out"].shape[1] // q_l
    B = qkv.shape[0]
    kv_l = (qkv.shape[1] // d - q_l) // 2
    q = qkv[:, :q_l * d].reshape(B, q_l, d)
    k = qkv[:, q_l * d:(q_l + kv_l) * d].reshape(B, kv_l, d)
    v = qkv[:, (q_l + kv_l) * d:].reshape(B, kv_l, d)
    cos, sin = ((ctl.cos, ctl.sin) if sc.rope == "host"
                else fused_tables(ctl.pos, t["inv_freq"], sc.rope_concentration))
    q, k = rope_apply(q, cos, sin), rope_apply(k, cos, sin)
    fp8 = FP8_MAX.get(sc.kv_dtype)
    if fp8:  # the kernel's quantize multipliers
        k, v = (k * sc.k_scale).clamp(-fp8, fp8), (v * sc.v_scale).clamp(-fp8, fp8)
    sliding = i % 2 == 0
    table = ctl.block_table_swa if sliding else ctl.block_table
    pos = ctl.pos_swa if sliding else ctl.pos
    start = ctl.swa_start[i]
    # prior context: the table's blocks, token by token, in frame positions 0..n*bs-1
    kb = K_half[table]  # [B, n, kv, block (/2, d, 2)]
    if sc.packed:
        kb = kvlayout.unpack_block(kb)
    kp = kb.to(torch.float32).permute(0, 2, 1, 3, 4).reshape(B, kv_l, -1, d)
    vp = V_half[table].to(torch.float32).permute(0, 2, 1, 3, 4).reshape(B, kv_l, -1, d)
    slot = torch.arange(kp.shape[2], device=qkv.device)
    visible = (slot[None, :] >= start[:, None]) & (slot[None, :] < pos[:, None])  # [B, S]
    g = q_l // kv_l
    qg = q.reshape(B, kv_l, g, d)
    scores = torch.einsum("bhgd,bhsd->bhgs", qg, kp) * sc.softmax_scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    active = torch.einsum("bhgd,bhd->bhg", qg, k)[..., None] * sc.softmax_scale
    sink = t["sink"][i].float().reshape(1, kv_l, g, 1).expand(B, -1, -1, -1)
    p = torch.softmax(torch.cat([scores, active, sink], dim=-1), dim=-1)
    out = torch.einsum("bhgs,bhsd->bhgd", p[..., :-2], vp) + p[..., -2:-1] * v[:, :, None, :]
    # the new token's K/V into the paged buffer at this layer's update index (-1: inactive row)
    idx = ctl.update_idx_swa if sliding else ctl.update_idx
    live = (idx >= 0)[:, None, None]
    blk, off = torch.div(idx, sc.block_size, rounding_mode="floor"), idx % sc.block_size
    k_max = min(fp8, PACKED_K_MAX) if fp8 and sc.packed else fp8
    k_new = torch.where(live, _store(k, K_half.dtype, k_max), kvlayout.read_k(K_half, blk, off, sc.packed))
    v_new = torch.where(live, _store(v, V_half.dtype, fp8), V_half[blk, :, off])
    kvlayout.write_k(K_half, blk, off, k_new, sc.packed)
    V_half[blk, :, off] = v_new
    return out.reshape(B, q_l * d)


def _store(x: torch.Tensor, dtype: torch.dtype, fp8_max: float | None) -> torch.Tensor:
    return x.clamp(-fp8_max, fp8_max).to(dtype) if fp8_max else x.to(dtype)


@dataclass
class RoutingGuide:
    """Teacher forcing for the router (verification only), at true ties alone: where the
    reference's own margin between its k-th and (k+1)-th router logits is at most ``tol`` and our
    top-k set differs, take the reference's set (recorded in ``taken`` [L, B]). Judged on the
    reference's logits, never ours: a set that differs anywhere else is kept, and recorded in
    ``departed`` [L, B] as a departure of that layer."""

    experts: torch.Tensor  # [L, B, k] the reference's choices for every token of the step
    gap: torch.Tensor  # [L, B] the reference's router margin for those tokens
    tol: float
    taken: torch.Tensor | None = None
    departed: torch.Tensor | None = None

    def __post_init__(self):
        if self.taken is None:
            self.taken = torch.zeros(self.gap.shape, dtype=torch.bool)
        if self.departed is None:
            self.departed = torch.zeros(self.gap.shape, dtype=torch.bool)

    @property
    def forced(self) -> int:
        """Token-layers whose routing took the reference's set."""
        return int(self.taken.sum())


def route(logits: torch.Tensor, k: int, guide: RoutingGuide | None = None, layer: int = 0):
    """Top-k experts and their affinities (softmax over the k chosen logits)."""
    top, idx = torch.topk(logits, k, dim=-1)
    if guide is not None:
        ref = guide.experts[layer].to(idx.device)
        differs = (idx.sort(-1).values != ref.sort(-1).values).any(-1).cpu()
        tie = guide.gap[layer] <= guide.tol
        take = differs & tie
        guide.departed[layer] |= differs & ~tie
        guide.taken[layer] |= take
        if take.any():
            idx = torch.where(take.to(idx.device)[:, None], ref, idx)
            top = logits.gather(1, idx)
    return idx, torch.softmax(top, dim=-1)


class ExpertCache:
    """Dequantized experts kept between eager steps, least recently used first out, within a
    byte budget: a tiny model keeps all of them, a 120b-wide one a few (each is ~113 MB)."""

    def __init__(self, budget: int = 1 << 30):
        self.budget, self.used = budget, 0
        self._items: dict = {}

    def get(self, key, make):
        if key in self._items:
            self._items[key] = self._items.pop(key)  # most recent last
            return self._items[key]
        w = make()
        size = w.nbytes
        while self._items and self.used + size > self.budget:
            self.used -= self._items.pop(next(iter(self._items))).nbytes
        if size <= self.budget:
            self._items[key] = w
            self.used += size
        return w


def expert_weights(t: dict, i: int, sc: Scalars, sel: slice = slice(None)):
    """Layer i's local experts ``sel`` as dense float32, stacked on a leading expert axis: gate/up
    [E, 2, in, Ip] (+ bias [E, 2, Ip]) and down [E, Ip, Hp] (+ bias [E, Hp]). MX tiles take their
    input in padded-HF hidden order (lane x holds h = sigma(x)); the bf16 layout takes lanes."""
    if sc.experts == "mxfp4":
        w = (mx.gate_up(t["expert_gate_up_weights"][i, sel], t["expert_gate_up_weights_scale"][i, sel]),
             mx.gate_up_bias(t["expert_gate_up_bias"][i, sel]),
             mx.down(t["expert_down_weights"][i, sel], t["expert_down_weights_scale"][i, sel]))
    else:
        w = (t["expert_gate_up_weights"][i, sel].permute(0, 2, 1, 3).float(), t["expert_gate_up_bias"][i, sel].float(),
             t["expert_down_weights"][i, sel].float())
    return w + (t["expert_down_bias"][i, sel].float(),)


class Expert:
    """Local expert e of layer i for eager use, read a block of rows at a time: the gate/up rows
    of some output columns j ([2, c, in] + bias [2, c]) and the down rows of some output lanes
    ([l, Ip] + bias [l]), as rows of the transposed weights, which a matmul takes as they are. MX
    tiles are read by ``mx``'s table-driven readers. ``columns``: the kernel column j each down
    column holds (None: in order)."""

    def __init__(self, t: dict, i: int, e: int, sc: Scalars):
        self.t, self.i, self.e, self.mx = t, i, e, sc.experts == "mxfp4"
        w = t["expert_gate_up_weights"]
        self.Ip = w.shape[-1]
        self.columns = mx.down_columns(self.Ip, t["expert_down_weights"].shape[-3]).to(w.device) if self.mx else None

    def gate_up(self, cols: slice = slice(None), out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``out``: a float32 buffer to read MX tiles into (``DecodedExpert``)."""
        t, i, e = self.t, self.i, self.e
        if self.mx:
            w = mx.gate_up_rows(t["expert_gate_up_weights"][i, e][..., cols], t["expert_gate_up_weights_scale"][i, e][..., cols],
                                out)
            return w, mx.gate_up_bias(t["expert_gate_up_bias"][i, e])[:, cols]
        return (t["expert_gate_up_weights"][i, e][..., cols].permute(1, 2, 0).float(),
                t["expert_gate_up_bias"][i, e][:, cols].float())

    def down(self, lanes: slice = slice(None), out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        t, i, e = self.t, self.i, self.e
        if self.mx:
            w = mx.down_rows(t["expert_down_weights"][i, e][..., lanes], t["expert_down_weights_scale"][i, e][..., lanes],
                             out)
        else:
            w = t["expert_down_weights"][i, e][:, lanes].T.float()
        return w, t["expert_down_bias"][i, e][lanes].float()

    @property
    def nbytes(self) -> int:
        return 0


class DecodedExpert(Expert):
    """An ``Expert`` read whole once and kept (``ExpertCache``, ``ahead``); blocks are views.
    ``out``: float32 buffers (gate_up, down) of ``buffer_sizes`` elements that MX tiles are read
    into (reused from expert to expert)."""

    def __init__(self, t: dict, i: int, e: int, sc: Scalars, out: tuple | None = None):
        super().__init__(t, i, e, sc)
        gu, down = out if out is not None and self.mx else (None, None)
        self._gu, self._down = Expert.gate_up(self, out=gu), Expert.down(self, out=down)

    def gate_up(self, cols: slice = slice(None)):
        return self._gu[0][:, cols], self._gu[1][:, cols]

    def down(self, lanes: slice = slice(None)):
        return self._down[0][lanes], self._down[1][lanes]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self._gu, *self._down))


def buffer_sizes(t: dict) -> tuple[int, int]:
    """Elements of a whole expert's float32 gate_up and down (``DecodedExpert``'s ``out``)."""
    Ip, Hp = t["expert_gate_up_weights"].shape[-1], t["expert_down_weights"].shape[-1]
    return 2 * Ip * Hp, Ip * Hp


def per_core(n: int) -> int:
    """Output columns (lanes) read and multiplied at a time: one block a core. Each block is a
    strided read of the tiles; at 120b widths, 256-column blocks spent a third of an expert's time
    on the reads' setup (measured: 83 ms against 62 ms an expert, bench/RESULTS.md)."""
    return -(-n // parallel.WORKERS)


def expert_forward(ex: Expert, x: torch.Tensor, sc: Scalars) -> torch.Tensor:
    """Rows x [n, in] (the expert's input order) through one expert -> [n, Hp], its weights read
    a block of output columns a core (``per_core``), the blocks on the host's cores."""
    n = x.shape[0]
    h = torch.empty(2, n, ex.Ip, device=x.device)
    step = per_core(ex.Ip)

    def up(j: int) -> None:
        w, b = ex.gate_up(slice(j, j + step))
        h[:, :, j:j + step] = torch.stack([x @ w[0].T, x @ w[1].T]) + b[:, None]

    parallel.each(up, range(0, ex.Ip, step))
    act = _swiglu(h[0], h[1], sc)
    act = act if ex.columns is None else act[:, ex.columns]
    y = torch.empty(n, sc.hidden_padded, device=x.device)
    step = per_core(sc.hidden_padded)

    def down(lane: int) -> None:
        w, b = ex.down(slice(lane, lane + step))
        y[:, lane:lane + step] = act @ w.T + b

    parallel.each(down, range(0, sc.hidden_padded, step))
    return y


def _swiglu(gate: torch.Tensor, up: torch.Tensor, sc: Scalars) -> torch.Tensor:
    gate = gate.clamp(max=sc.gate_clamp_upper_limit)
    up = up.clamp(sc.up_clamp_lower_limit, sc.up_clamp_upper_limit)  # +1 is in the up bias
    return gate * torch.sigmoid(1.702 * gate) * up


@dataclass
class Probe:
    """Fixed rows ``x`` [n, Hp] (kernel lanes, after the MoE's RMSNorm) that every local expert of
    a layer also runs on, routed or not; ``out`` collects {global expert: [n, Hp]}."""

    x: torch.Tensor
    out: dict = field(default_factory=dict)


def router(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The router's logits of rows x [B, Hp]: [B, E] (``w`` [Hp, E], ``b`` [E] float32)."""
    return x @ w + b


def experts(t: dict, i: int, x: torch.Tensor, sc: Scalars, guide: RoutingGuide | None = None,
            memo: ExpertCache | None = None, probe: Probe | None = None,
            logits: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's experts over every token, each scaled by its routing affinity (0 if not chosen).
    ``probe``: every local expert also runs on the probe's rows (eager only). ``memo``: where decoded
    experts come from (``ExpertCache``, or ``ahead.ExpertsAhead``: read ahead on other threads).
    ``logits``: ``router`` of x with this rank's router, when the caller made them (the replay makes
    them once for the ranks that map one router's bytes)."""
    if logits is None:
        logits = router(x, t["router_weights"][i].float(), t["router_bias"][i].float())
    idx, weights = route(logits, sc.top_k, guide if sc.ep_rank == 0 else _copy(guide), i)
    lo = sc.ep_rank * sc.experts_per_rank
    aff = torch.zeros_like(logits).scatter(1, idx, weights)[:, lo:lo + sc.experts_per_rank]  # [B, E_L]
    order = torch.from_numpy(hidden.sigma(sc.hidden_padded)).argsort().to(x.device)
    ins = (lambda v: v[:, order]) if sc.experts == "mxfp4" else (lambda v: v)  # noqa: E731 - the experts' input order
    if torch.compiler.is_compiling():  # traced: the kernel's all-expert form, every token, every expert
        x = ins(x)
        gu, gu_b, down, down_b = expert_weights(t, i, sc)
        h = _swiglu(torch.einsum("bh,ehj->ebj", x, gu[:, 0]) + gu_b[:, 0, None],
                    torch.einsum("bh,ehj->ebj", x, gu[:, 1]) + gu_b[:, 1, None], sc)
        y = torch.einsum("ebj,ejx->ebx", h, down) + down_b[:, None]
        return (aff.T[..., None] * y).sum(0)
    # eager: only the experts with routed rows (or a probe) are dequantized, each over those rows
    # (the others have affinity 0: same numbers), only those rows put in the experts' input order
    out = torch.zeros(x.shape[0], sc.hidden_padded, device=x.device)
    px = None if probe is None else ins(probe.x)
    for e in range(sc.experts_per_rank):
        rows = torch.nonzero(aff[:, e]).flatten()
        if not len(rows) and px is None:
            continue
        ex = (memo.get((sc.ep_rank, i, e), lambda: DecodedExpert(t, i, e, sc)) if memo is not None
              else Expert(t, i, e, sc))
        y = expert_forward(ex, ins(x[rows]) if px is None else torch.cat([ins(x[rows]), px]), sc)
        out[rows] += aff[rows, e, None] * y[:len(rows)]
        if px is not None:
            probe.out[lo + e] = y[len(rows):]
    return out


def _copy(guide: RoutingGuide | None) -> RoutingGuide | None:
    """Every EP rank routes every token the same way; only rank 0 counts the forced choices."""
    return None if guide is None else RoutingGuide(guide.experts, guide.gap, guide.tol)


def embed(weight: torch.Tensor, ids: torch.Tensor, placement: str, comm,
          x_shard_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The fused-embedding prologue (fork F's ``gpt_oss_decode_mega_kernel``): this rank's x
    [T_shard, Hp] float32 from its embedding shard and its DP replica's B_attn token ids.

    vocab: ``weight`` [ceil(V/TP), Hp], ``ids`` local rows (-1: another TP rank's); the rows this
    rank owns, zeros elsewhere, reduce-scattered over the TP group (one non-zero term a token:
    exact). hidden: ``weight`` [V, Hp/TP], ``ids`` global; the lane slices are all-gathered over
    the TP group along the hidden axis and ``x_shard_ids`` picks this rank's token rows."""
    if placement == "vocab":
        rows = torch.where((ids >= 0)[:, None], weight[ids.clamp(min=0)].float(), 0.0)  # not 0 * row: NaN rows
        return comm.reduce_scatter(rows, "tp")
    full = comm.all_gather(weight[ids].float().T.contiguous(), "tp").T  # lanes concatenated in TP order
    return full[x_shard_ids]


def step(t: dict, x: torch.Tensor, kv, ctl: Control, sc: Scalars, comm, hiddens: list | None = None,
         guide: RoutingGuide | None = None, memo: ExpertCache | None = None,
         on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """One decode step of this rank: x [T_shard, Hp] -> [T_shard, Hp].

    ``t``: the rank's tensors by argument name; ``kv``: its KV cache (``kv.k(layer)`` that layer's
    entry in the kernel's K view, ``kv.v(layer)``; either form), updated in place; ``hiddens`` collects x after every layer; ``guide``
    steers true-tie routing to the reference (verification); ``memo`` caches dequantized experts;
    ``on_layer(i)`` is told when layer i is done (progress).
    """
    f = lambda name, i: t[name][i].float()  # noqa: E731
    for i in range(sc.num_layers):
        X = comm.all_gather(x, "tp")
        a = attention(t, i, qkv(t, i, rms_norm(X, f("input_layernorm_weight", i), sc.eps, sc.hidden_actual)),
                      kv.k(i), kv.v(i), ctl, sc)
        x = x + comm.reduce_scatter(a @ f("W_out", i) + f("bias_out", i), "tp")
        M = comm.all_gather(x, "ep")
        m = experts(t, i, rms_norm(M, f("post_attn_layernorm_weight", i), sc.eps, sc.hidden_actual), sc, guide, memo)
        x = x + comm.reduce_scatter(m, "ep")
        if hiddens is not None:
            hiddens.append(x)
        if on_layer is not None:
            on_layer(i)
    return x
