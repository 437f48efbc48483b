"""The reference model, streamed: transformers' GPT-OSS modules one decoder layer at a time.

Memory is flat in experts, and in layers past a budget. Each pass (the prompts' common prefix, then
one pass a position) runs every sequence's new tokens through one decoder layer at a time, loaded
from the memory-mapped checkpoint on first use and kept for the later passes while the kept layers
fit ``LAYERS_KEEP`` (120b: 108 MB a layer, 3.9 GB for all 36). Attention, RoPE, the norms and the
router are transformers' own modules (``GptOssAttention``, ``GptOssRotaryEmbedding``,
``GptOssRMSNorm``, ``GptOssTopKRouter``) loaded with the layer's weights; the experts follow
transformers' ``GptOssExperts`` math (same order of summation), their MXFP4 weights decoded by
transformers' own dequantization (``hf_mxfp4``), only the experts the router chose, a few rows at a
time. Over a dense (bf16/fp32) source the checkpoint is read through ``quantized.mx_view``: with a
scale rule, the MXFP4 reference (the quantization the build does); with ``rule=None``, the dense
original, whose experts are ``x @ w + b`` on the float32 weights as transformers computes them. The first pass also runs every expert of every layer on fixed probe rows (what verify checks
each expert shard against, routed or not). The embedding is read row by row; the lm_head is converted to float32 once
(in vocabulary slices) and kept while there are passes left.

Prompts may differ in length: a position past a sequence's prompt takes its greedy token, so every
sequence has ``max(prompt length) + steps`` positions.

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

from . import heap, hf_mxfp4, jsonio, parallel
from .checkpoint import names
from .checkpoint.reader import Checkpoint
from .errors import GkError
from .pipeline.manifest import kv_meta
from .progress import steps_bar

FP8_MAX = {"fp8_e4m3": 240.0, "fp8_e4m3fn": 448.0}
KV_FORMATS = ("fp32", "bf16", *FP8_MAX)
LM_HEAD_ROWS = 16384  # vocabulary rows of the lm_head converted to fp32 at a time
LM_HEAD_KEEP = 4 << 30  # bytes of float32 lm_head kept between passes at most (120b: 2.3 GB)
LAYERS_KEEP = 4 << 30  # bytes of float32 layer modules kept between passes at most (120b: 108 MB a layer)
READ_AHEAD = 4  # experts of a pass being read from disk ahead of the ones computing (~13 MB each at 120b)
PROBES = 4  # rows every expert runs on (verify checks each expert shard against them)


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


def hf_config(root, kv: KvFormat):
    """transformers' GptOssConfig of a checkpoint folder (or of a ``ranged.Remote``'s config.json),
    with our attention for a rounded cache."""
    from transformers import GptOssConfig

    if isinstance(root, Path | str):
        cfg = GptOssConfig.from_pretrained(str(root))
    else:
        from .checkpoint.ranged import MAX_CONFIG

        cfg = GptOssConfig.from_dict(jsonio.loads(root.small("config.json", MAX_CONFIG), f"{root.uri}/config.json"))
    cfg._attn_implementation = "eager" if kv.dtype == "fp32" else _register_attention()
    return cfg


def _bf16(arr: np.ndarray) -> torch.Tensor:
    """A bf16 numpy view (ml_dtypes) -> a float32 torch copy."""
    return torch.from_numpy(np.array(arr).view(np.int16)).view(torch.bfloat16).float()


def dense(ck) -> bool:
    """Whether ``ck`` serves the dense original's experts (``Quantized`` with no scale rule)."""
    from .checkpoint.quantized import Quantized

    return isinstance(ck, Quantized) and ck.rule is None


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
        self.ck, self.prefix, self.device, self.index = ck, p, device, i
        self.nbytes = sum(t.nbytes for m in (self.attn, self.norm1, self.norm2, self.router)
                          for t in m.state_dict().values())
        self.limit, self.alpha = cfg.swiglu_limit, 1.702
        self.num_experts = cfg.num_local_experts
        self.dense = dense(ck)
        for name in self._mx() + [f"{p}mlp.experts.{proj}_bias" for proj in names.PROJS]:
            ck.read(name, 0, 0)  # its file mapped here: the experts are read on the pool's threads

    @staticmethod
    def _read(ck: Checkpoint, name: str, device: str) -> torch.Tensor:
        t = _bf16(ck.read(name)).to(device)
        ck.release(name)
        return t

    def _mx(self) -> list[str]:
        """The names of this layer's expert weights: MXFP4 blocks and scales of both projections, or
        the dense original's ``gate_up_proj`` / ``down_proj``."""
        parts = ("",) if self.dense else ("_blocks", "_scales")
        return [f"{self.prefix}mlp.experts.{proj}{part}" for proj in ("gate_up_proj", "down_proj") for part in parts]

    def prefetch(self, e: int) -> None:
        """Start reading expert e's MXFP4 weights from disk (they are read when computed: at 36
        layers the checkpoint is larger than the page cache, and a pass's experts come from disk)."""
        for name in self._mx():
            self.ck.prefetch(name, e, e + 1)

    def expert(self, e: int, x: torch.Tensor, check: bool = False) -> torch.Tensor:
        """Expert e of this layer on rows x [n, H] (transformers' GptOssExperts math, float32),
        its MXFP4 weights decoded as transformers decodes them (``hf_mxfp4``) a few rows at a time.
        ``check``: first compare that decode with a real ``convert_moe_packed_tensors`` call."""
        if self.dense:
            return self._dense_expert(e, x)
        ck, p = self.ck, self.prefix + "mlp.experts."
        w = {}
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = ck.read(p + proj + "_blocks", e, e + 1)[0], ck.read(p + proj + "_scales", e, e + 1)[0]
            if check:
                hf_mxfp4.check_layout(blocks, scales, f"{self.prefix}{proj} expert {e}")
            w[proj] = (blocks, scales, _bf16(ck.read(p + proj + "_bias", e, e + 1)[0]).to(self.device))
        h = hf_mxfp4.matmul_t(x, *w["gate_up_proj"][:2]) + w["gate_up_proj"][2]
        gate, up = h[..., ::2].clamp(max=self.limit), h[..., 1::2].clamp(-self.limit, self.limit)
        y = hf_mxfp4.matmul_t((up + 1) * gate * torch.sigmoid(gate * self.alpha), *w["down_proj"][:2])
        for name in self._mx():
            ck.release(name, e, e + 1)
        return y + w["down_proj"][2]

    def _dense_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e of the dense original: ``gate_up_proj`` [H, 2I] and ``down_proj`` [I, H] as float32,
        ``x @ w + b`` (transformers==5.24.0 transformers/models/gpt_oss/modeling_gpt_oss.py:108-110,
        the gate at :82-88)."""
        ck, p = self.ck, self.prefix + "mlp.experts."
        w = {proj: (torch.from_numpy(np.array(ck.read(p + proj, e, e + 1)[0], np.float32)).to(self.device),
                    _bf16(ck.read(p + proj + "_bias", e, e + 1)[0]).to(self.device)) for proj in names.PROJS}
        for name in self._mx():
            ck.release(name, e, e + 1)
        h = x @ w["gate_up_proj"][0] + w["gate_up_proj"][1]
        gate, up = h[..., ::2].clamp(max=self.limit), h[..., 1::2].clamp(-self.limit, self.limit)
        return ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ w["down_proj"][0] + w["down_proj"][1]

    def experts(self, x: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor,
                probe: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every token through its chosen experts, computed on the host's cores (an expert a thread:
        fewer waits than its chunks a thread), summed in ascending order as transformers'
        GptOssExperts adds them. With ``probe`` [n, H], every expert of the layer
        also runs on those rows (routed or not): (out, probe outputs [E, n, H]), and the first
        expert's decode is checked against transformers' function."""
        out = torch.zeros_like(x)
        probed = None if probe is None else torch.empty(self.num_experts, *probe.shape, device=x.device)
        todo = list(range(self.num_experts)) if probe is not None else torch.unique(idx).tolist()
        for e in todo[:READ_AHEAD]:
            self.prefetch(e)

        def run(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if k + READ_AHEAD < len(todo):
                self.prefetch(todo[k + READ_AHEAD])
            e = todo[k]
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            rows = x[tok] if probe is None else torch.cat([x[tok], probe])
            return tok, slot, self.expert(e, rows, check=probe is not None and e == 0)

        for e, (tok, slot, y) in zip(todo, parallel.each(run, range(len(todo)))):
            out.index_add_(0, tok, y[:len(tok)] * scores[tok, slot, None])
            if probe is not None:
                probed[e] = y[len(tok):]
        return out, probed

    def forward(self, x, pos_emb, mask, cache: _Cache, probe: torch.Tensor | None = None):
        """x [P, n, H] -> (x after the layer, top-k experts [P, n, k], router gap [P, n]: the
        margin between the k-th and (k+1)-th router logits, i.e. how far from a tie the choice
        is, probe outputs [E, n_probe, H] or None)."""
        P, n, H = x.shape
        a, _ = self.attn(self.norm1(x), position_embeddings=pos_emb, attention_mask=mask, cache=cache,
                         gk_cache=cache)
        x = x + a
        flat = self.norm2(x).reshape(-1, H)
        logits, scores, idx = self.router(flat)
        k = idx.shape[-1]
        top = torch.topk(logits, k + 1, dim=-1).values if k < logits.shape[-1] else None
        gap = (top[:, k - 1] - top[:, k]) if top is not None else torch.full((flat.shape[0],), float("inf"))
        moe, probed = self.experts(flat, idx, scores, probe)
        x = x + moe.reshape(P, n, H)
        return x, idx.reshape(P, n, k), gap.reshape(P, n), probed


class _Layers:
    """The decoder layers, each loaded on first use and kept between passes while the kept ones fit
    ``keep`` bytes (loading reads and converts a layer's attention, norms and router to float32)."""

    def __init__(self, ck: Checkpoint, cfg, device: str, keep: int):
        self.ck, self.cfg, self.device, self.keep = ck, cfg, device, keep
        self.kept: dict[int, Layer] = {}

    def __getitem__(self, i: int) -> Layer:
        layer = self.kept.get(i)
        if layer is None:
            layer = Layer(self.ck, self.cfg, i, self.device)
            if sum(k.nbytes for k in self.kept.values()) + layer.nbytes <= self.keep:
                self.kept[i] = layer
        return layer


def _mask(positions: torch.Tensor, total: int, window: int | None) -> torch.Tensor:
    """Additive mask [1, 1, n, total]: causal, and within ``window`` for sliding layers."""
    j = torch.arange(total)[None, :]
    i = positions[:, None]
    ok = j <= i
    if window:
        ok &= j > i - window
    return torch.zeros(ok.shape).masked_fill(~ok, float("-inf"))[None, None]


def probe_rows(hidden: int, n: int = PROBES, seed: int = 0) -> torch.Tensor:
    """The fixed rows every expert runs on: standard normal, RMS 1 like an RMSNorm output."""
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def build_kv(m: dict) -> KvFormat:
    """The KV format a build's kernel stores (dtype and dequant scales), from its manifest."""
    return KvFormat.from_meta(kv_meta(m))


def build_rule(m: dict) -> str:
    """The scale rule a build quantized its dense source's experts by (its manifest's
    ``source.quantize``), the default one for an MXFP4 source (which has none, and ignores it)."""
    return (m["source"].get("quantize") or {}).get("scale_rule", "round_up")


def host_memory() -> int:
    """This host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_size(cfg, prompts: list[list[int]], steps: int) -> None:
    """Refuse, before any model work, a run the reference cannot hold: past the model's
    max_position_embeddings, or needing more memory than this host has. ``cfg``: gkbuild's or
    transformers' GPT-OSS config (the same field names). The bound is what ``run`` keeps at once at
    least: its outputs (logits [P, T, V], hidden states [P, L + 1, T, H], fp32) and the first pass's
    attention weights over the common prefix (three [P, heads, n, n + 1] fp32 tensors in ``_attention``)."""
    P, T, common = len(prompts), max(map(len, prompts), default=0) + steps, min(map(len, prompts), default=0)
    if T > cfg.max_position_embeddings:
        raise GkError(f"{T} positions (the longest prompt plus {steps} steps) exceed the model's "
                      f"max_position_embeddings of {cfg.max_position_embeddings}")
    need = 4 * P * T * (cfg.vocab_size + (cfg.num_hidden_layers + 1) * cfg.hidden_size) \
        + 3 * 4 * P * cfg.num_attention_heads * common * (common + 1)
    have = host_memory()
    if need > have:
        raise GkError(f"{P} sequences x {T} positions need at least {need / 2**30:.1f} GiB for the reference "
                      f"(logits, hidden states, attention weights), this host has {have / 2**30:.1f} GiB; "
                      f"give fewer or shorter prompts or fewer steps")


def open_checkpoint(root, rule: str | None = "round_up") -> Checkpoint:
    """A checkpoint folder mapped, or a ``checkpoint.ranged.Remote`` read by range, as the reference
    reads it (``quantized.mx_view``): an MXFP4 one as it is; a dense one quantized by ``rule`` (the
    MXFP4 reference of a build with that scale rule) or, with ``rule=None``, its dense original."""
    from .checkpoint.quantized import mx_view

    if isinstance(root, Path | str):
        return mx_view(Checkpoint.open(root), rule)
    from .checkpoint.ranged import RangedCheckpoint

    return mx_view(RangedCheckpoint.open_remote(root), rule)


def run(root: Path, prompts: list[list[int]], steps: int, kv: KvFormat = KvFormat(), device: str = "cpu",
        quiet: bool = True, on_kv=None, rule: str | None = "round_up", info: dict | None = None
        ) -> dict[str, torch.Tensor]:
    """(``root``: a checkpoint folder, or a ``checkpoint.ranged.Remote``.) Greedy continuation of each prompt until every sequence has ``max(len(prompt)) + steps``
    tokens, layer by layer: one pass for the prompts' common prefix, one a position after it.
    Returns ``token_ids`` [P, T], ``logits`` [P, T, V], ``hidden`` [P, L, T, H] (after every
    layer), ``routing`` [P, L, T, k] (the experts chosen), ``router_gap`` [P, L, T] (the margin
    between the k-th and (k+1)-th router logits), ``final_norm`` [P, T, H] (the final RMSNorm's
    output: the lm_head's input), ``expert_inputs`` [n, H] and ``expert_outputs`` [L, E, n, H]
    (every expert of every layer on the probe rows).
    ``on_kv(layer, k, v)`` sees each pass's new K (after RoPE) and V [P, kv heads, n, d] before
    the cache rounds them (a DI prefill writes them in its own layout). ``rule``: how a dense
    source's experts are read (``open_checkpoint``); an MXFP4 source ignores it. ``info``, if given,
    gets ``source_layout``: how the source holds its experts (``names.LAYOUTS``)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm, GptOssRotaryEmbedding

    if device == "cuda" and not torch.cuda.is_available():
        raise GkError("--device cuda: no CUDA device is available on this host")
    if not prompts or any(not p for p in prompts):
        raise GkError("every prompt needs at least one token")
    heap.reuse_large_blocks()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the parallelism is the experts' (parallel.each); tiny matmuls gain nothing
    ck = open_checkpoint(root, rule)
    if info is not None:
        info["source_layout"] = getattr(ck, "source_layout", ck.layout)
    try:
        cfg = hf_config(root, kv)
        V, L = cfg.vocab_size, cfg.num_hidden_layers
        if any(not 0 <= t < V for p in prompts for t in p):
            raise GkError(f"prompt token ids must be in 0..{V - 1}")
        with torch.device(device):
            rotary = GptOssRotaryEmbedding(cfg)
        norm = GptOssRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norm.load_state_dict({"weight": Layer._read(ck, names.FINAL_NORM, device)}, assign=True)
        check_size(cfg, prompts, steps)
        T = max(map(len, prompts)) + steps
        common = min(map(len, prompts))
        ids = torch.tensor([p[:common] for p in prompts], dtype=torch.int64)
        probe = probe_rows(cfg.hidden_size).to(device)
        head = _LmHead(ck, V, keep=T > common)
        layers = _Layers(ck, cfg, device, LAYERS_KEEP if T > common else 0)
        cache = _Cache(kv, on_kv)
        new, chunks, probed = ids, [], []
        passes = T - common + 1
        with torch.no_grad(), steps_bar("reference", passes * L, quiet) as advance:
            for s in range(passes):
                start = ids.shape[1] - new.shape[1]
                pos = torch.arange(start, ids.shape[1])
                x = _embed(ck, new).to(device)
                pos_emb = rotary(x, pos[None].to(device))
                hid, route, gap = [], [], []
                for i in range(L):
                    layer = layers[i]
                    window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
                    x, r, g, out = layer.forward(x, pos_emb, _mask(pos, ids.shape[1], window).to(device), cache,
                                                 probe if s == 0 else None)
                    del layer
                    hid.append(x.cpu())
                    route.append(r.cpu())
                    gap.append(g.cpu())
                    if out is not None:
                        probed.append(out.cpu())
                    where = f"positions 1-{common}/{T}" if s == 0 else f"position {ids.shape[1]}/{T}"
                    advance(1, f"{where}, layer {i + 1}/{L}")
                h = norm(x)
                logits = head(h)
                chunks.append((logits, torch.stack(hid, 1), torch.stack(route, 1), torch.stack(gap, 1), h.cpu()))
                if s < passes - 1:
                    t = ids.shape[1]  # the next position: its prompt token, or the greedy one
                    greedy = logits[:, -1].argmax(-1)
                    new = torch.tensor([[p[t] if t < len(p) else int(greedy[j])] for j, p in enumerate(prompts)])
                    ids = torch.cat([ids, new], dim=1)
    finally:
        ck.close()
        torch.set_num_threads(threads)
    cat = [torch.cat([c[j] for c in chunks], dim=1 if j in (0, 4) else 2) for j in range(5)]
    return {"token_ids": ids, "logits": cat[0], "hidden": cat[1], "routing": cat[2].to(torch.int64),
            "router_gap": cat[3], "final_norm": cat[4], "expert_inputs": probe.cpu(),
            "expert_outputs": torch.stack(probed)}


def _embed(ck: Checkpoint, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows of the tokens only (each read, and checked, alone)."""
    rows = [_bf16(ck.read(names.EMBED, t, t + 1)) for t in ids.reshape(-1).tolist()]
    ck.release(names.EMBED)
    return torch.cat(rows).reshape(*ids.shape, -1)


class _LmHead:
    """h [P, n, H] -> logits [P, n, V] float32, the lm_head converted a vocabulary slice at a time;
    with ``keep`` (more passes to come) the float32 copy is kept, up to ``LM_HEAD_KEEP`` bytes."""

    def __init__(self, ck: Checkpoint, V: int, keep: bool):
        self.ck, self.V = ck, V
        self.keep = keep and V * ck.info(names.LM_HEAD).shape[1] * 4 <= LM_HEAD_KEEP
        self.slices: dict[int, torch.Tensor] = {}
        ck.read(names.LM_HEAD, 0, 1)  # its file mapped here, before the slices are read on threads

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*h.shape[:-1], self.V)

        def part(lo: int) -> None:
            hi = min(self.V, lo + LM_HEAD_ROWS)
            w = self.slices.get(lo)
            if w is None:
                w = _bf16(self.ck.read(names.LM_HEAD, lo, hi)).to(h.device)
                self.ck.release(names.LM_HEAD, lo, hi)
                if self.keep:
                    self.slices[lo] = w
            out[..., lo:hi] = (h @ w.T).cpu()

        parallel.each(part, range(0, self.V, LM_HEAD_ROWS))
        return out
