"""The GPT-OSS model configuration, read from (and written as) a hub ``config.json``, and presets.

Only what gkbuild needs is kept; the rest of a hub config is carried through untouched in
``extra`` so a synthesized checkpoint's config looks like the real one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import GkError, shown

# What a config may say before anything is sized from it (the real models are far below).
LIMITS = {"num_hidden_layers": 1024, "num_local_experts": 4096, "experts_per_token": 4096, "hidden_size": 1 << 17,
          "intermediate_size": 1 << 17, "num_attention_heads": 1024, "num_key_value_heads": 1024,
          "head_dim": 4096, "vocab_size": 1 << 22, "sliding_window": 1 << 24}
MAX_CONFIG = 16 << 20  # a config.json is a few KB

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class Rope:
    """YaRN RoPE parameters (NeoX half-split rotation)."""

    theta: float = 150000.0
    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = False

    @property
    def concentration(self) -> float:
        """YaRN's attention factor: multiplies cos and sin."""
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclass(frozen=True)
class GptOssConfig:
    num_hidden_layers: int
    num_local_experts: int
    experts_per_token: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    sliding_window: int
    layer_types: tuple[str, ...]
    rope: Rope = Rope()
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    max_position_embeddings: int = 131072
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    # -- short names used throughout the layout code ---------------------------------------
    @property
    def L(self) -> int:
        return self.num_hidden_layers

    @property
    def E(self) -> int:
        return self.num_local_experts

    @property
    def H(self) -> int:
        return self.hidden_size

    @property
    def I(self) -> int:  # noqa: E743 - the model's own letter
        return self.intermediate_size

    @property
    def q_heads(self) -> int:
        return self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def d(self) -> int:
        return self.head_dim

    @property
    def V(self) -> int:
        return self.vocab_size

    @property
    def top_k(self) -> int:
        return self.experts_per_token

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    # -- construction -------------------------------------------------------------------------
    def with_layers(self, n: int) -> "GptOssConfig":
        """The same model cut to its first ``n`` layers (synthesized test checkpoints)."""
        if not 1 <= n <= self.num_hidden_layers:
            raise GkError(f"layers must be between 1 and {self.num_hidden_layers}, got {n}")
        return dataclasses.replace(self, num_hidden_layers=n, layer_types=self.layer_types[:n])

    def validate(self, where: str = "config") -> "GptOssConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise GkError(f"{where}: {msg}")

        for name, top in LIMITS.items():
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= top,
                 f"{name} must be an integer in 1..{top}, got {shown(v)}")
        r = self.rope
        for name, v, lo in (("rope_theta", r.theta, 0.0), ("rope factor", r.factor, 0.0),
                            ("rope beta_fast", r.beta_fast, None), ("rope beta_slow", r.beta_slow, None),
                            ("rms_norm_eps", self.rms_norm_eps, 0.0), ("swiglu_limit", self.swiglu_limit, 0.0),
                            ("swiglu_alpha", self.swiglu_alpha, 0.0)):
            need(math.isfinite(v) and (lo is None or v > lo),
                 f"{name} must be a finite{' positive' if lo is not None else ''} number, got {v!r}")
        for name, v in (("original_max_position_embeddings", r.original_max_position_embeddings),
                        ("max_position_embeddings", self.max_position_embeddings)):
            need(0 < v <= 1 << 24, f"{name} must be in 1..{1 << 24}, got {v}")
        need(self.experts_per_token <= self.num_local_experts,
             f"experts_per_token {self.experts_per_token} exceeds num_local_experts {self.num_local_experts}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads {self.num_key_value_heads}")
        need(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even (half-split RoPE)")
        need(self.hidden_size % 32 == 0, f"hidden_size {self.hidden_size} must be a multiple of 32 (MXFP4 blocks)")
        need(self.intermediate_size % 32 == 0,
             f"intermediate_size {self.intermediate_size} must be a multiple of 32 (MXFP4 blocks)")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
        need(not bad, f"layer_types has unknown kinds {bad}; expected {SLIDING!r} or {FULL!r}")
        return self

    @classmethod
    def from_hf(cls, d: dict, where: str = "config.json") -> "GptOssConfig":
        """Read a hub ``config.json`` dict (old ``rope_scaling`` or new ``rope_parameters`` form)."""
        if not isinstance(d, dict):
            raise GkError(f"{where}: expected a JSON object")
        if d.get("model_type") not in (None, "gpt_oss"):
            raise GkError(f"{where}: model_type is {d.get('model_type')!r}, gkbuild builds 'gpt_oss' models")
        # No quantization_config: a dense (bf16/fp32) checkpoint, as transformers saves a dequantized
        # fine-tune; the reader holds the tensors to what the config says (it stays in ``extra``).
        q = d.get("quantization_config", _ABSENT)
        if q is not _ABSENT and (not isinstance(q, dict) or q.get("quant_method") != "mxfp4"):
            raise GkError(f"{where}: quantization_config.quant_method must be 'mxfp4' (an MXFP4 checkpoint), "
                          f"or no quantization_config (a dense bf16/fp32 one)")
        required = ["num_hidden_layers", "num_local_experts", "hidden_size", "intermediate_size",
                    "num_attention_heads", "num_key_value_heads", "vocab_size"]
        missing = [k for k in required if k not in d]
        if missing:
            raise GkError(f"{where}: missing keys {missing}")
        if d.get("num_experts_per_tok", d.get("experts_per_token")) is None:
            raise GkError(f"{where}: missing key 'num_experts_per_tok'")

        def integer(key: str, v, lo: int = 1, hi: int = 1 << 31):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise GkError(f"{where}: {key} must be an integer in {lo}..{hi}, got {shown(v)}")
            return v

        def number(key: str, v) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise GkError(f"{where}: {key} must be a finite number, got {shown(v)}")
            return float(v)

        ints = {k: integer(k, d[k]) for k in required}
        for k, top in LIMITS.items():  # range checks before anything is sized from them
            if k in ints and ints[k] > top:
                raise GkError(f"{where}: {k} must be an integer in 1..{top}, got {ints[k]}")
        top_k = integer("num_experts_per_tok", d.get("num_experts_per_tok", d.get("experts_per_token")))
        L = ints["num_hidden_layers"]
        layer_types = d.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(L)]
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise GkError(f"{where}: layer_types must be a list of strings, got {shown(layer_types)}")
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rp, dict):
            raise GkError(f"{where}: rope_scaling must be an object, got {shown(rp)}")
        if rp and rp.get("rope_type", "yarn") != "yarn":
            raise GkError(f"{where}: rope type {shown(rp.get('rope_type'))} is not supported (GPT-OSS uses 'yarn')")
        rope = Rope(
            theta=number("rope_theta", rp.get("rope_theta", d.get("rope_theta", Rope.theta))),
            factor=number("rope factor", rp.get("factor", Rope.factor)),
            beta_fast=number("rope beta_fast", rp.get("beta_fast", Rope.beta_fast)),
            beta_slow=number("rope beta_slow", rp.get("beta_slow", Rope.beta_slow)),
            original_max_position_embeddings=integer(
                "original_max_position_embeddings",
                rp.get("original_max_position_embeddings", Rope.original_max_position_embeddings)),
            truncate=bool(rp.get("truncate", True)),
        )
        known = set(required) | {"num_experts_per_tok", "experts_per_token", "layer_types", "rope_parameters",
                                 "rope_scaling", "rope_theta", "head_dim", "sliding_window", "rms_norm_eps",
                                 "swiglu_limit", "max_position_embeddings"}
        cfg = cls(
            num_hidden_layers=L,
            num_local_experts=ints["num_local_experts"],
            experts_per_token=top_k,
            hidden_size=ints["hidden_size"],
            intermediate_size=ints["intermediate_size"],
            num_attention_heads=ints["num_attention_heads"],
            num_key_value_heads=ints["num_key_value_heads"],
            head_dim=integer("head_dim", d.get("head_dim") or ints["hidden_size"] // ints["num_attention_heads"]),
            vocab_size=ints["vocab_size"],
            sliding_window=integer("sliding_window", d.get("sliding_window") or 128),
            layer_types=tuple(layer_types),
            rope=rope,
            rms_norm_eps=number("rms_norm_eps", d.get("rms_norm_eps", 1e-5)),
            swiglu_limit=number("swiglu_limit", d.get("swiglu_limit", 7.0)),
            max_position_embeddings=integer("max_position_embeddings", d.get("max_position_embeddings", 131072)),
            extra={k: v for k, v in d.items() if k not in known},
        )
        return cfg.validate(where)

    @classmethod
    def from_file(cls, path: Path) -> "GptOssConfig":
        from .jsonio import read

        try:
            d = read(Path(path), MAX_CONFIG)
        except FileNotFoundError:
            raise GkError(f"{path}: no config.json (not a checkpoint folder?)") from None
        except IsADirectoryError:
            raise GkError(f"{path}: is a folder, not a config file") from None
        return cls.from_hf(d, where=str(path))

    def to_hf(self) -> dict:
        """The hub ``config.json`` form (as openai/gpt-oss-* publish it)."""
        # The hub's special tokens; a small synthetic vocabulary keeps them in range.
        pad, eos = (199999, 200002) if self.vocab_size > 200002 else (self.vocab_size - 1, self.vocab_size - 2)
        d = {
            "architectures": ["GptOssForCausalLM"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "eos_token_id": eos,
            "experts_per_token": self.experts_per_token,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initial_context_length": self.rope.original_max_position_embeddings,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "model_type": "gpt_oss",
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.experts_per_token,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_local_experts": self.num_local_experts,
            "output_router_logits": False,
            "pad_token_id": pad,
            "quantization_config": {
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"],
                "quant_method": "mxfp4",
            },
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": {
                "beta_fast": self.rope.beta_fast,
                "beta_slow": self.rope.beta_slow,
                "factor": self.rope.factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
                "rope_type": "yarn",
                "truncate": self.rope.truncate,
            },
            "rope_theta": self.rope.theta,
            "router_aux_loss_coef": 0.9,
            "sliding_window": self.sliding_window,
            "swiglu_limit": self.swiglu_limit,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }
        for k, v in self.extra.items():
            d.setdefault(k, v)
        return d

    def structure(self) -> dict:
        """Everything but the layer count: what identifies a model family (for preset matching)."""
        d = dataclasses.asdict(self)
        for k in ("num_hidden_layers", "layer_types", "extra"):
            d.pop(k)
        return d


_ABSENT = object()


def _alternating(n: int) -> tuple[str, ...]:
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(n))


def _preset(L, E, H, I, q, kv, d, V, W) -> GptOssConfig:
    return GptOssConfig(
        num_hidden_layers=L, num_local_experts=E, experts_per_token=4, hidden_size=H,
        intermediate_size=I, num_attention_heads=q, num_key_value_heads=kv, head_dim=d,
        vocab_size=V, sliding_window=W, layer_types=_alternating(L),
    ).validate("preset")


PRESETS: dict[str, GptOssConfig] = {
    "gpt-oss-120b": _preset(36, 128, 2880, 2880, 64, 8, 64, 201088, 128),
    "gpt-oss-20b": _preset(24, 32, 2880, 2880, 64, 8, 64, 201088, 128),
    # World size 1. Hidden and intermediate 960 pad to 1024 (two 512-wide MX tiles each, 64 pad
    # lanes), window 8 so a 16-step verify crosses it.
    "tiny": _preset(2, 8, 960, 960, 8, 2, 64, 4096, 8),
    # The 120b *counts* that decide sharding (64 q / 8 kv heads, 128 experts, top-4, alternating
    # layers) at tiny widths: hidden 448 -> 512, vocab 2048 = 128 vocab ranks x 16.
    "tiny-topology": _preset(2, 128, 448, 448, 64, 8, 32, 2048, 8),
}

PRESET_DESCRIPTIONS = {
    "gpt-oss-120b": "openai/gpt-oss-120b shapes (36 layers, 128 experts)",
    "gpt-oss-20b": "openai/gpt-oss-20b shapes (24 layers, 32 experts)",
    "tiny": "2 layers, 8 experts, hidden 960: the cpu demo (world size 1)",
    "tiny-topology": "120b head/expert counts at tiny widths: the TP8 x DP16 x EP128 test model",
}


def preset(name: str) -> GptOssConfig:
    try:
        return PRESETS[name]
    except KeyError:
        import difflib

        near = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise GkError(f"unknown preset {name!r}{hint}; presets: {', '.join(PRESETS)}") from None


def match_preset(cfg: GptOssConfig) -> str | None:
    """The preset whose structure this config has (any layer count), if one does."""
    s = cfg.structure()
    for name, p in PRESETS.items():
        if p.structure() == s:
            return name
    return None
