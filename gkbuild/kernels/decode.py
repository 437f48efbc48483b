"""The GK decode step for one rank, in plain PyTorch, reading the build's shard layouts.

Per layer i (the giga-kernel's layer body, CONTRACT.md section 2):

    X   = all_gather_tp(x)                              this DP replica's tokens
    a   = attention(rmsnorm(X)) @ W_out[i] + bias_out   QKV fused, YaRN RoPE, paged KV with
                                                         sinks; sliding layers read the trimmed
                                                         block table in window-frame positions
    x   = x + reduce_scatter_tp(a)
    M   = all_gather_ep(x)                              every token
    m   = sum over this rank's experts e of affinity_e * expert_e(rmsnorm(M))
    x   = x + reduce_scatter_ep(m)

Activations are float32 (weights are exact in it); RMSNorm divides by the real hidden size (the
pad lanes are zero); the new token's K/V is written into the rank's paged buffers (packed FP8 K
through ``layout.kv.write_k``). FP8 KV follows the nki twin: stored = clamp(value / scale) in the
format, the active token attends at that scale unrounded, and the dequant scales live in
softmax_scale and W_out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import hidden, kv as kvlayout
from . import mx
from .rope import apply as rope_apply

FP8_MAX = {"fp8_e4m3": 240.0, "fp8_e4m3fn": 448.0}


@dataclass
class Scalars:
    num_layers: int
    eps: float
    hidden_actual: int
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
    ep_rank: int
    experts_per_rank: int

    @classmethod
    def from_manifest(cls, m: dict, ep_rank: int) -> "Scalars":
        s, kv = m["scalars"], m["layout"]["kv"]
        e_l = m["model"]["num_local_experts"] // m["topology"]["ep"]
        return cls(num_layers=s["num_layers"], eps=s["eps"], hidden_actual=s["hidden_actual"], top_k=s["top_k"],
                   softmax_scale=s["softmax_scale"], gate_clamp_upper_limit=s["gate_clamp_upper_limit"],
                   up_clamp_upper_limit=s["up_clamp_upper_limit"], up_clamp_lower_limit=s["up_clamp_lower_limit"],
                   k_scale=s["k_scale"], v_scale=s["v_scale"], kv_dtype=kv["dtype"], packed=kv["packed"],
                   block_size=kv["block_size"], ep_rank=ep_rank, experts_per_rank=e_l)


@dataclass
class Control:
    """Layer-invariant inputs for one step of one DP replica (B_attn rows)."""

    cos: torch.Tensor  # [B, d/2]
    sin: torch.Tensor
    block_table: torch.Tensor  # [B, nbf] full-attention layers (odd)
    block_table_swa: torch.Tensor  # [B, num_swa] trimmed, sliding layers (even)
    pos: torch.Tensor  # [B] absolute position of the new token
    pos_swa: torch.Tensor  # [B] its position in the trimmed window's frame
    swa_start: torch.Tensor  # [L, B] first visible frame position (0 on full layers)
    update_idx: torch.Tensor  # [B] flat slot block*block_size + offset; -1: inactive row
    update_idx_swa: torch.Tensor


class Weights:
    """One rank's stacked tensors, made float32 once; MX experts dequantized from their tiles."""

    def __init__(self, t: dict, experts: str, hidden_padded: int):
        f = lambda n: t[n].to(torch.float32)  # noqa: E731
        self.ln_in, self.ln_post = f("input_layernorm_weight"), f("post_attn_layernorm_weight")
        self.W_qkv, self.bias_qkv, self.W_out, self.bias_out = f("W_qkv"), f("bias_qkv"), f("W_out"), f("bias_out")
        self.sink = f("sink")
        self.router_w, self.router_b = f("router_weights"), f("router_bias")
        self.embed = t["embed_tokens"]
        self.gamma = f("gamma")
        self.lm_head_t = t["lm_head_weight_t"]
        L, E_L = t["expert_gate_up_weights"].shape[:2]
        # experts as dense float32 [2, in, Ip] gate/up and [Ip, Hp] down. MX tiles take their input
        # in padded-HF hidden order (lane x holds h = sigma(x)); the bf16 layout takes lanes.
        if experts == "mxfp4":
            self.to_hidden = torch.from_numpy(hidden.sigma(hidden_padded)).argsort()
            self.gate_up = [[mx.gate_up(t["expert_gate_up_weights"][i, e], t["expert_gate_up_weights_scale"][i, e])
                             for e in range(E_L)] for i in range(L)]
            self.gate_up_b = [[mx.gate_up_bias(t["expert_gate_up_bias"][i, e]) for e in range(E_L)] for i in range(L)]
            self.down = [[mx.down(t["expert_down_weights"][i, e], t["expert_down_weights_scale"][i, e])
                          for e in range(E_L)] for i in range(L)]
        else:  # [Hp (lanes), 2, Ip], bias [2, Ip], down [Ip, Hp]
            self.to_hidden = None
            self.gate_up = [[t["expert_gate_up_weights"][i, e].permute(1, 0, 2).to(torch.float32) for e in range(E_L)]
                            for i in range(L)]
            self.gate_up_b = [[t["expert_gate_up_bias"][i, e].to(torch.float32) for e in range(E_L)] for i in range(L)]
            self.down = [[t["expert_down_weights"][i, e].to(torch.float32) for e in range(E_L)] for i in range(L)]
        self.down_b = f("expert_down_bias")


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, hidden_actual: int) -> torch.Tensor:
    """RMSNorm over the real hidden size: the pad lanes are zero and stay out of the mean."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / hidden_actual + eps) * gamma


def _store(x: torch.Tensor, dtype: torch.dtype, fp8_max: float | None) -> torch.Tensor:
    return x.clamp(-fp8_max, fp8_max).to(dtype) if fp8_max else x.to(dtype)


def attention(w: Weights, i: int, X: torch.Tensor, K_half, V_half, ctl: Control, sc: Scalars) -> torch.Tensor:
    """One layer's attention for this rank's heads over the replica's rows: [B, q_l*d]."""
    d = w.W_out.shape[1] // w.sink.shape[1]
    q_l = w.sink.shape[1]
    qkv = X @ w.W_qkv[i] + w.bias_qkv[i]
    B = X.shape[0]
    kv_l = (qkv.shape[1] // d - q_l) // 2
    q = qkv[:, :q_l * d].view(B, q_l, d)
    k = qkv[:, q_l * d:(q_l + kv_l) * d].view(B, kv_l, d)
    v = qkv[:, (q_l + kv_l) * d:].view(B, kv_l, d)
    q, k = rope_apply(q, ctl.cos, ctl.sin), rope_apply(k, ctl.cos, ctl.sin)
    fp8 = FP8_MAX.get(sc.kv_dtype)
    if fp8:  # the kernel's quantize multipliers
        k, v = (k * sc.k_scale).clamp(-fp8, fp8), (v * sc.v_scale).clamp(-fp8, fp8)
    sliding = i % 2 == 0
    table = ctl.block_table_swa if sliding else ctl.block_table
    pos = ctl.pos_swa if sliding else ctl.pos
    start = ctl.swa_start[i]
    bs = sc.block_size
    # prior context: the table's blocks, token by token, in frame positions 0..n*bs-1
    kb = K_half[table]  # [B, n, kv, block(/2, d, 2)]
    if sc.packed:
        kb = kvlayout.unpack_block(kb)
    kp = kb.to(torch.float32).permute(0, 2, 1, 3, 4).reshape(B, kv_l, -1, d)
    vp = V_half[table].to(torch.float32).permute(0, 2, 1, 3, 4).reshape(B, kv_l, -1, d)
    slot = torch.arange(kp.shape[2])
    visible = (slot[None, :] >= start[:, None]) & (slot[None, :] < pos[:, None])  # [B, S]
    g = q_l // kv_l
    qg = q.view(B, kv_l, g, d)
    scores = torch.einsum("bhgd,bhsd->bhgs", qg, kp) * sc.softmax_scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    active = torch.einsum("bhgd,bhd->bhg", qg, k)[..., None] * sc.softmax_scale
    sink = w.sink[i].view(1, kv_l, g, 1).expand(B, -1, -1, -1)
    logits = torch.cat([scores, active, sink], dim=-1)
    p = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgs,bhsd->bhgd", p[..., :-2], vp) + p[..., -2:-1] * v[:, :, None, :]
    # write the new token's K/V into the paged buffer at this layer's update index
    idx = ctl.update_idx_swa if sliding else ctl.update_idx
    for b in range(B):
        slot_b = int(idx[b])
        if slot_b < 0:
            continue
        blk, off = divmod(slot_b, bs)
        kvlayout.write_k(K_half, blk, off, _store(k[b], K_half.dtype, fp8), sc.packed)
        V_half[blk, :, off] = _store(v[b], V_half.dtype, fp8)
    return out.reshape(B, q_l * d)


@dataclass
class RoutingGuide:
    """Teacher forcing for the router (verification only): where this model's top-k set differs
    from the reference's only by a near tie (every reference expert scores within ``tol`` of our
    k-th choice), take the reference's set, so rounding in one step cannot send a token to another
    expert and derail the rest of its sequence. A set that differs by more is kept: that is a bug."""

    experts: torch.Tensor  # [L, B, k] the reference's choices for every token of the step
    tol: float
    forced: int = 0


def route(logits: torch.Tensor, k: int, guide: RoutingGuide | None = None, layer: int = 0):
    """Top-k experts and their affinities (softmax over the k chosen logits)."""
    top, idx = torch.topk(logits, k, dim=-1)
    if guide is not None:
        ref = guide.experts[layer]
        differs = (idx.sort(-1).values != ref.sort(-1).values).any(-1)
        near = (logits.gather(1, ref) >= top[:, -1:] - guide.tol).all(-1)
        take = differs & near
        if take.any():
            guide.forced += int(take.sum())
            idx = torch.where(take[:, None], ref, idx)
            top = logits.gather(1, idx)
    return idx, torch.softmax(top, dim=-1)


def experts(w: Weights, i: int, x: torch.Tensor, sc: Scalars, guide: RoutingGuide | None = None) -> torch.Tensor:
    """This rank's experts over every token, each scaled by its routing affinity (0 if not chosen)."""
    logits = x @ w.router_w[i] + w.router_b[i]
    idx, weights = route(logits, sc.top_k, guide if sc.ep_rank == 0 else _copy(guide), i)
    aff = torch.zeros_like(logits).scatter(1, idx, weights)
    lo = sc.ep_rank * sc.experts_per_rank
    xe = x[:, w.to_hidden] if w.to_hidden is not None else x  # the order the expert weights take
    out = torch.zeros_like(x)
    for e in range(sc.experts_per_rank):
        # The kernel runs every token through the expert and scales by the affinity; tokens not
        # routed here have affinity 0, so only the routed rows are computed (same numbers).
        rows = torch.nonzero(aff[:, lo + e]).flatten()
        if not len(rows):
            continue
        gu, bias = w.gate_up[i][e], w.gate_up_b[i][e]
        gate = (xe[rows] @ gu[0] + bias[0]).clamp(max=sc.gate_clamp_upper_limit)
        up = (xe[rows] @ gu[1] + bias[1]).clamp(sc.up_clamp_lower_limit, sc.up_clamp_upper_limit)  # +1 in bias
        h = gate * torch.sigmoid(1.702 * gate) * up
        out[rows] += aff[rows, lo + e, None] * (h @ w.down[i][e] + w.down_b[i, e])
    return out


def _copy(guide: RoutingGuide | None) -> RoutingGuide | None:
    """Every EP rank routes every token the same way; only rank 0 counts the forced choices."""
    return None if guide is None else RoutingGuide(guide.experts, guide.tol)


def step(w: Weights, x: torch.Tensor, kv, ctl: Control, sc: Scalars, comm, hiddens: list | None = None,
         guide: RoutingGuide | None = None):
    """One decode step of this rank: x [T_shard, Hp] -> [T_shard, Hp]. ``kv`` gives the rank's
    buffers (``kv.k(g)``, ``kv.v(g)``); ``hiddens``, if given, collects x after every layer;
    ``guide`` steers near-tie routing to the reference's choice (verification)."""
    for i in range(sc.num_layers):
        X = comm.all_gather(x, "tp")
        a = attention(w, i, rms_norm(X, w.ln_in[i], sc.eps, sc.hidden_actual), kv.k(i // 2), kv.v(i // 2), ctl, sc)
        x = x + comm.reduce_scatter(a @ w.W_out[i] + w.bias_out[i], "tp")
        M = comm.all_gather(x, "ep")
        x = x + comm.reduce_scatter(experts(w, i, rms_norm(M, w.ln_post[i], sc.eps, sc.hidden_actual), sc, guide),
                                    "ep")
        if hiddens is not None:
            hiddens.append(x)
    return x
