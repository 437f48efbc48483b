"""The reference model, streamed: transformers' GPT-OSS modules one decoder layer at a time.

Memory is flat in layers and experts. Each pass (the prompts' prefill, then one pass per greedy
step) loads one decoder layer from the memory-mapped checkpoint, runs every sequence's new tokens
through it, and frees it. Attention, RoPE, the norms and the router are transformers' own modules
(``GptOssAttention``, ``GptOssRotaryEmbedding``, ``GptOssRMSNorm``, ``GptOssTopKRouter``) loaded
with the layer's weights; the experts are ours: only the experts the router chose are dequantized
from MXFP4, one at a time, each applied to its tokens (transformers' expert loop, same order).
The embedding is read row by row and the lm_head a vocabulary slice at a time.

The KV cache emulates the build's (``KvFormat``): K and V are rounded when they are written
(bf16, or FP8 at the recipe's dequant scales with the format's saturation) and later positions
attend over the rounded values, while a token attends to its own K/V unrounded, as the GK kernel
does. ``KvFormat("fp32")`` keeps the cache exact: the numbers of transformers' full model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint import mxfp4, names
from .checkpoint.reader import Checkpoint
from .errors import GkError
from .progress import steps_bar

FP8_MAX = {"fp8_e4m3": 240.0, "fp8_e4m3fn": 448.0}
KV_FORMATS = ("fp32", "bf16", *FP8_MAX)
LM_HEAD_ROWS = 16384  # vocabulary rows of the lm_head converted to fp32 at a time
MAX_WORKERS = 8  # experts dequantized ahead at most (each ~100 MB at 120b widths)


@dataclass(frozen=True)
class KvFormat:
    """How the emulated KV cache stores K and V: ``dtype`` and, for FP8, the dequant scales
    (value = stored * scale; the kernel multiplies by their reciprocals before the cast)."""

    dtype: str = "fp32"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self):
        if self.dtype not in KV_FORMATS:
            raise GkError(f"unknown KV format {self.dtype!r}; known: {', '.join(KV_FORMATS)}")
        if not (self.k_scale > 0 and self.v_scale > 0 and math.isfinite(self.k_scale * self.v_scale)):
            raise GkError(f"KV scales must be positive and finite, got k {self.k_scale}, v {self.v_scale}")

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_MAX

    def active(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """What the writing token itself attends to: FP8 saturates at the scale, unrounded."""
        if not self.fp8:
            return x
        m = FP8_MAX[self.dtype]
        return (x * (1.0 / scale)).clamp(-m, m) * scale

    def encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """The values a cache of this format holds: bf16, or FP8 of x / scale saturated at the
        format's max (both FP8 formats carried by float8_e4m3fn: after the clamp their values
        are bit-identical); fp32 as it is."""
        if self.dtype == "fp32":
            return x
        if self.dtype == "bf16":
            return x.to(torch.bfloat16)
        m = FP8_MAX[self.dtype]
        return (x * (1.0 / scale)).clamp(-m, m).to(torch.float8_e4m3fn)

    def stored(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """What later tokens read back: the encoded value, dequantized."""
        e = self.encode(x, scale).to(x.dtype)
        return e * scale if self.fp8 else e

    def to_meta(self) -> dict:
        return {"dtype": self.dtype, "k_scale": self.k_scale, "v_scale": self.v_scale}

    @classmethod
    def from_meta(cls, d: dict) -> "KvFormat":
        return cls(d["dtype"], float(d["k_scale"]), float(d["v_scale"]))


class _Cache:
    """One layer-indexed KV cache over the sequences, rounded on write. transformers' attention
    calls ``update``; the rounding-aware attention reads ``active`` (this call's own K/V)."""

    def __init__(self, fmt: KvFormat, on_kv=None):
        self.fmt = fmt
        self.on_kv = on_kv
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.active: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        f = self.fmt
        if self.on_kv is not None:
            self.on_kv(layer_idx, key_states, value_states)
        self.active = (f.active(key_states, f.k_scale), f.active(value_states, f.v_scale))
        k, v = f.stored(key_states, f.k_scale), f.stored(value_states, f.v_scale)
        if layer_idx in self.k:
            k, v = torch.cat([self.k[layer_idx], k], dim=2), torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v


def _attention(module, query, key, value, attention_mask, scaling, dropout=0.0, gk_cache=None, **kwargs):
    """transformers' eager GPT-OSS attention (sinks, max-subtracted softmax), except that each
    query's own key and value are the unrounded ones its layer just wrote (``gk_cache.active``)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import repeat_kv

    g = module.num_key_value_groups
    k_act, v_act = (repeat_kv(t, g) for t in gk_cache.active)
    ks, vs = repeat_kv(key, g), repeat_kv(value, g)
    n, S = query.shape[2], ks.shape[2]
    w = torch.matmul(query, ks.transpose(2, 3)) * scaling
    own = torch.diagonal(w[..., S - n:], dim1=-2, dim2=-1)  # a view: query i at its own slot
    own.copy_((query * k_act).sum(-1) * scaling)
    if attention_mask is not None:
        w = w + attention_mask
    sinks = module.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, n, -1)
    logits = torch.cat([w, sinks], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    p_own = torch.diagonal(probs[..., S - n:], dim1=-2, dim2=-1)[..., None]  # [P, h, n, 1]
    out = torch.matmul(probs, vs) + p_own * (v_act - vs[..., S - n:, :])
    return out.transpose(1, 2).contiguous(), probs


def _register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register("gkbuild_kv", _attention)
    return "gkbuild_kv"


def hf_config(root: Path, kv: KvFormat):
    """transformers' GptOssConfig of a checkpoint folder, with our attention for a rounded cache."""
    from transformers import GptOssConfig

    cfg = GptOssConfig.from_pretrained(str(root))
    cfg._attn_implementation = "eager" if kv.dtype == "fp32" else _register_attention()
    return cfg


def _bf16(arr: np.ndarray) -> torch.Tensor:
    """A bf16 numpy view (ml_dtypes) -> a float32 torch copy."""
    return torch.from_numpy(np.array(arr).view(np.int16)).view(torch.bfloat16).float()


class Layer:
    """One decoder layer's transformers modules, loaded from the checkpoint (experts excepted)."""

    def __init__(self, ck: Checkpoint, cfg, i: int, device: str):
        from transformers.models.gpt_oss import modeling_gpt_oss as hf

        p = names.layer_prefix(i)
        with torch.device("meta"):
            self.attn = hf.GptOssAttention(cfg, i)
            self.norm1 = hf.GptOssRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.norm2 = hf.GptOssRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.router = hf.GptOssTopKRouter(cfg)
        for mod, prefix in ((self.attn, "self_attn."), (self.norm1, "input_layernorm."),
                            (self.norm2, "post_attention_layernorm."), (self.router, "mlp.router.")):
            state = {k: self._read(ck, p + prefix + k, device) for k in mod.state_dict()}
            mod.load_state_dict(state, assign=True)
            mod.eval()
        self.ck, self.prefix, self.device = ck, p, device
        self.limit, self.alpha = cfg.swiglu_limit, 1.702
        self.workers = min(os.cpu_count() or 1, MAX_WORKERS)

    @staticmethod
    def _read(ck: Checkpoint, name: str, device: str) -> torch.Tensor:
        t = _bf16(ck.read(name)).to(device)
        ck.release(name)
        return t

    def expert(self, e: int):
        """Expert e dequantized: gate_up [2I, H] (gate and up rows interleaved), its bias, down
        [H, I], its bias (float32)."""
        ck, p = self.ck, self.prefix + "mlp.experts."
        out = []
        for w in ("gate_up_proj", "down_proj"):
            blocks, scales = p + w + "_blocks", p + w + "_scales"
            dense = mxfp4.decode(ck.read(blocks, e, e + 1)[0], ck.read(scales, e, e + 1)[0])
            ck.release(blocks, e, e + 1)
            ck.release(scales, e, e + 1)
            out += [torch.from_numpy(dense).to(self.device), _bf16(ck.read(p + w + "_bias", e, e + 1)[0]).to(self.device)]
        return out

    def experts(self, x: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Every token through its chosen experts, each expert dequantized once and freed: the sum
        over experts in ascending order, as transformers' GptOssExperts adds them. Up to
        ``workers`` experts are dequantized ahead on threads (numpy releases the GIL)."""
        out = torch.zeros_like(x)
        hit = torch.unique(idx).tolist()
        for e, (gu, gu_b, down, down_b) in zip(hit, _ahead(self.expert, hit, self.workers)):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            h = x[tok] @ gu.T + gu_b
            gate, up = h[..., ::2].clamp(max=self.limit), h[..., 1::2].clamp(-self.limit, self.limit)
            y = ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ down.T + down_b
            out.index_add_(0, tok, y * scores[tok, slot, None])
            del gu, down
        return out

    def forward(self, x, pos_emb, mask, cache: _Cache):
        """x [P, n, H] -> (x after the layer, top-k experts [P, n, k], router gap [P, n]: the
        margin between the k-th and (k+1)-th router logits, i.e. how far from a tie the choice is)."""
        P, n, H = x.shape
        a, _ = self.attn(self.norm1(x), position_embeddings=pos_emb, attention_mask=mask, cache=cache,
                         gk_cache=cache)
        x = x + a
        flat = self.norm2(x).reshape(-1, H)
        logits, scores, idx = self.router(flat)
        k = idx.shape[-1]
        top = torch.topk(logits, k + 1, dim=-1).values if k < logits.shape[-1] else None
        gap = (top[:, k - 1] - top[:, k]) if top is not None else torch.full((flat.shape[0],), float("inf"))
        x = x + self.experts(flat, idx, scores).reshape(P, n, H)
        return x, idx.reshape(P, n, k), gap.reshape(P, n)


def _ahead(fn, items: list, workers: int):
    """``fn`` of each item, in order, with at most ``workers`` being computed ahead on threads
    while the caller uses the last one: memory holds ``workers`` + 1 results at most."""
    if workers <= 1:
        yield from map(fn, items)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for it in items:
            pending.append(pool.submit(fn, it))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _mask(positions: torch.Tensor, total: int, window: int | None) -> torch.Tensor:
    """Additive mask [1, 1, n, total]: causal, and within ``window`` for sliding layers."""
    j = torch.arange(total)[None, :]
    i = positions[:, None]
    ok = j <= i
    if window:
        ok &= j > i - window
    return torch.zeros(ok.shape).masked_fill(~ok, float("-inf"))[None, None]


def run(root: Path, prompts: list[list[int]], steps: int, kv: KvFormat = KvFormat(), device: str = "cpu",
        quiet: bool = True, on_kv=None) -> dict[str, torch.Tensor]:
    """Greedy continuation of each prompt by ``steps`` tokens, layer by layer: one pass for the
    prompts, one per generated token. Returns ``token_ids`` [P, T], ``logits`` [P, T, V],
    ``hidden`` [P, L, T, H] (after every layer), ``routing`` [P, L, T, k] (the experts chosen) and
    ``router_gap`` [P, L, T] (the margin between the k-th and (k+1)-th router logits).
    ``on_kv(layer, k, v)`` sees each pass's new K (after RoPE) and V [P, kv heads, n, d] before
    the cache rounds them (a DI prefill writes them in its own layout)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm, GptOssRotaryEmbedding

    if device == "cuda" and not torch.cuda.is_available():
        raise GkError("--device cuda: no CUDA device is available on this host")
    if len({len(p) for p in prompts}) != 1 or not prompts[0]:
        raise GkError("all prompts must have the same, nonzero length")
    ck = Checkpoint.open(root)
    try:
        cfg = hf_config(root, kv)
        V, L = cfg.vocab_size, cfg.num_hidden_layers
        if any(not 0 <= t < V for p in prompts for t in p):
            raise GkError(f"prompt token ids must be in 0..{V - 1}")
        with torch.device(device):
            rotary = GptOssRotaryEmbedding(cfg)
        norm = GptOssRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norm.load_state_dict({"weight": Layer._read(ck, names.FINAL_NORM, device)}, assign=True)
        ids = torch.tensor(prompts, dtype=torch.int64)
        cache = _Cache(kv, on_kv)
        new, chunks = ids, []
        with torch.no_grad(), steps_bar("reference", (steps + 1) * L, quiet) as advance:
            for s in range(steps + 1):
                start = ids.shape[1] - new.shape[1]
                pos = torch.arange(start, ids.shape[1])
                x = _embed(ck, new).to(device)
                pos_emb = rotary(x, pos[None].to(device))
                hid, route, gap = [], [], []
                for i in range(L):
                    layer = Layer(ck, cfg, i, device)
                    window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
                    x, r, g = layer.forward(x, pos_emb, _mask(pos, ids.shape[1], window).to(device), cache)
                    del layer
                    hid.append(x.cpu())
                    route.append(r.cpu())
                    gap.append(g.cpu())
                    advance(1, f"pass {s + 1}/{steps + 1}, layer {i + 1}/{L}")
                logits = _lm_head(ck, norm(x), V)
                chunks.append((logits, torch.stack(hid, 1), torch.stack(route, 1), torch.stack(gap, 1)))
                if s < steps:
                    new = logits[:, -1].argmax(-1, keepdim=True)
                    ids = torch.cat([ids, new], dim=1)
    finally:
        ck.close()
    cat = [torch.cat([c[j] for c in chunks], dim=2 if j else 1) for j in range(4)]
    return {"token_ids": ids, "logits": cat[0], "hidden": cat[1], "routing": cat[2].to(torch.int64),
            "router_gap": cat[3]}


def _embed(ck: Checkpoint, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows of the tokens only."""
    table = ck.read(names.EMBED)
    out = _bf16(table[ids.reshape(-1).numpy()]).reshape(*ids.shape, table.shape[1])
    ck.release(names.EMBED)
    return out


def _lm_head(ck: Checkpoint, h: torch.Tensor, V: int) -> torch.Tensor:
    """h [P, n, H] -> logits [P, n, V] fp32, the lm_head read a vocabulary slice at a time."""
    out = torch.empty(*h.shape[:-1], V)
    w = ck.read(names.LM_HEAD)
    for lo in range(0, V, LM_HEAD_ROWS):
        hi = min(V, lo + LM_HEAD_ROWS)
        out[..., lo:hi] = (h @ _bf16(w[lo:hi]).to(h.device).T).cpu()
        ck.release(names.LM_HEAD, lo, hi)
    return out
