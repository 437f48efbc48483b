"""The HF checkpoint's tensor names, shapes and dtypes for a config: the name map, apart from I/O.

Everything that reads or writes a GPT-OSS checkpoint asks this module what should be there.

Two layouts hold the experts (``LAYOUTS``):
- ``mxfp4``: OpenAI's published checkpoints: ``mlp.experts.{gate_up,down}_proj_{blocks,scales}``,
  [E, out, in/32, 16] and [E, out, in/32] u8, blocked along the contraction axis; everything else
  bf16.
- ``bf16`` / ``fp32``: a fine-tune as transformers saves it once training has dequantized the
  experts: ``gate_up_proj`` [E, H, 2I] (gate and up interleaved on the last axis) and
  ``down_proj`` [E, I, H], the contraction axis first: ``x @ w`` (transformers==5.24.0:
  transformers/models/gpt_oss/modeling_gpt_oss.py:75-78, the interleave at :83, the product at
  :108-110; its MXFP4 integration dequantizes to that by transposing the blocks' [E, out, in]:
  transformers/integrations/mxfp4.py:285). Every float tensor has the layout's dtype.
"""

from __future__ import annotations

from ..model import GptOssConfig
from .safetensors_io import TensorSpec

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


LAYOUTS = ("mxfp4", "bf16", "fp32")
EXPERTS = "mlp.experts."
MX_PARTS = ("_blocks", "_scales")
PROJS = ("gate_up_proj", "down_proj")


def dense_expert(name: str) -> bool:
    """A dense (transformers-layout) expert weight: ``...mlp.experts.gate_up_proj`` / ``down_proj``."""
    return name.endswith(tuple(EXPERTS + p for p in PROJS))


def mx_expert(name: str) -> bool:
    return EXPERTS in name and name.endswith(MX_PARTS)


def layer_specs(cfg: GptOssConfig, layer: int, layout: str = "mxfp4") -> list[TensorSpec]:
    """One layer's tensors, in the order a checkpoint keeps them (attention, then MoE)."""
    from .mxfp4 import BLOCK  # (numpy with it: imported when specs are listed, not by a no-op build)

    H, I, E, d = cfg.H, cfg.I, cfg.E, cfg.d
    q, kv = cfg.q_heads * d, cfg.kv_heads * d
    p = layer_prefix(layer)
    bf = "bf16" if layout == "mxfp4" else layout
    if layout == "mxfp4":
        experts = [
            TensorSpec(p + "mlp.experts.gate_up_proj_blocks", "u8", (E, 2 * I, H // BLOCK, BLOCK // 2)),
            TensorSpec(p + "mlp.experts.gate_up_proj_scales", "u8", (E, 2 * I, H // BLOCK)),
            TensorSpec(p + "mlp.experts.gate_up_proj_bias", bf, (E, 2 * I)),
            TensorSpec(p + "mlp.experts.down_proj_blocks", "u8", (E, H, I // BLOCK, BLOCK // 2)),
            TensorSpec(p + "mlp.experts.down_proj_scales", "u8", (E, H, I // BLOCK)),
            TensorSpec(p + "mlp.experts.down_proj_bias", bf, (E, H)),
        ]
    else:
        experts = [
            TensorSpec(p + "mlp.experts.gate_up_proj", bf, (E, H, 2 * I)),
            TensorSpec(p + "mlp.experts.gate_up_proj_bias", bf, (E, 2 * I)),
            TensorSpec(p + "mlp.experts.down_proj", bf, (E, I, H)),
            TensorSpec(p + "mlp.experts.down_proj_bias", bf, (E, H)),
        ]
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
        *experts,
    ]


def expected_specs(cfg: GptOssConfig, layout: str = "mxfp4") -> list[TensorSpec]:
    """Every tensor of the checkpoint, in file order: embedding, layers, final norm, lm_head."""
    bf = "bf16" if layout == "mxfp4" else layout
    out = [TensorSpec(EMBED, bf, (cfg.V, cfg.H))]
    for layer in range(cfg.L):
        out += layer_specs(cfg, layer, layout)
    out += [TensorSpec(FINAL_NORM, bf, (cfg.H,)), TensorSpec(LM_HEAD, bf, (cfg.V, cfg.H))]
    return out


def detect_layout(dtypes: dict[str, str], where: str) -> str:
    """The layout of a checkpoint from its tensors' names and dtypes (name -> gkbuild dtype name).

    A checkpoint holding experts of both layouts (half converted) is refused naming one of each.
    The dtype of a dense layout is its first dense expert's; ``expected_specs`` then holds every
    other float tensor to it.
    """
    from ..errors import GkError

    mx = next((n for n in sorted(dtypes) if mx_expert(n)), None)
    dense = next((n for n in sorted(dtypes) if dense_expert(n)), None)
    if mx and dense:
        raise GkError(f"{where}: a mixed checkpoint: {dense} is a dense expert weight (transformers' layout) but "
                      f"{mx} is MXFP4; convert all of it (gkbuild quantize) or none")
    if dense is None:
        return "mxfp4"
    if dtypes[dense] not in LAYOUTS[1:]:
        raise GkError(f"{where}: tensor {dense} is {dtypes[dense]}; dense experts must be bf16 or fp32")
    return dtypes[dense]


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
    if mx_expert(name):
        return "experts (mxfp4)"
    if dense_expert(name):
        return "experts (dense)"
    if EXPERTS in name:
        return "expert biases"
    return "other"
