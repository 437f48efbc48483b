"""The HF checkpoint's tensor names, shapes and dtypes for a config: the name map, apart from I/O.

Everything that reads or writes a GPT-OSS checkpoint asks this module what should be there.
"""

from __future__ import annotations

from ..model import GptOssConfig
from .safetensors_io import TensorSpec

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def layer_specs(cfg: GptOssConfig, layer: int) -> list[TensorSpec]:
    """One layer's tensors, in the order a checkpoint keeps them (attention, then MoE)."""
    from .mxfp4 import BLOCK  # (numpy with it: imported when specs are listed, not by a no-op build)

    H, I, E, d = cfg.H, cfg.I, cfg.E, cfg.d
    q, kv = cfg.q_heads * d, cfg.kv_heads * d
    p = layer_prefix(layer)
    bf = "bf16"
    return [
        TensorSpec(p + "input_layernorm.weight", bf, (H,)),
        TensorSpec(p + "self_attn.q_proj.weight", bf, (q, H)),
        TensorSpec(p + "self_attn.q_proj.bias", bf, (q,)),
        TensorSpec(p + "self_attn.k_proj.weight", bf, (kv, H)),
        TensorSpec(p + "self_attn.k_proj.bias", bf, (kv,)),
        TensorSpec(p + "self_attn.v_proj.weight", bf, (kv, H)),
        TensorSpec(p + "self_attn.v_proj.bias", bf, (kv,)),
        TensorSpec(p + "self_attn.o_proj.weight", bf, (H, q)),
        TensorSpec(p + "self_attn.o_proj.bias", bf, (H,)),
        TensorSpec(p + "self_attn.sinks", bf, (cfg.q_heads,)),
        TensorSpec(p + "post_attention_layernorm.weight", bf, (H,)),
        TensorSpec(p + "mlp.router.weight", bf, (E, H)),
        TensorSpec(p + "mlp.router.bias", bf, (E,)),
        TensorSpec(p + "mlp.experts.gate_up_proj_blocks", "u8", (E, 2 * I, H // BLOCK, BLOCK // 2)),
        TensorSpec(p + "mlp.experts.gate_up_proj_scales", "u8", (E, 2 * I, H // BLOCK)),
        TensorSpec(p + "mlp.experts.gate_up_proj_bias", bf, (E, 2 * I)),
        TensorSpec(p + "mlp.experts.down_proj_blocks", "u8", (E, H, I // BLOCK, BLOCK // 2)),
        TensorSpec(p + "mlp.experts.down_proj_scales", "u8", (E, H, I // BLOCK)),
        TensorSpec(p + "mlp.experts.down_proj_bias", bf, (E, H)),
    ]


def expected_specs(cfg: GptOssConfig) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in file order: embedding, layers, final norm, lm_head."""
    out = [TensorSpec(EMBED, "bf16", (cfg.V, cfg.H))]
    for layer in range(cfg.L):
        out += layer_specs(cfg, layer)
    out += [TensorSpec(FINAL_NORM, "bf16", (cfg.H,)), TensorSpec(LM_HEAD, "bf16", (cfg.V, cfg.H))]
    return out


def kind(name: str) -> str:
    """A coarse tensor kind, for summaries."""
    if name == EMBED:
        return "embedding"
    if name == LM_HEAD:
        return "lm_head"
    if name.endswith("layernorm.weight") or name == FINAL_NORM:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.router." in name:
        return "router"
    if name.endswith(("_blocks", "_scales")):
        return "experts (mxfp4)"
    if ".mlp.experts." in name:
        return "expert biases"
    return "other"
