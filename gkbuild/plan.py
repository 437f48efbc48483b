"""The layout plan: for a recipe and a model config, every rank's tensors, files, bytes and the KV
budget, computed before any weight is read. Pure: no I/O.

Files are unique shards named by role; a rank loads the shared file, its TP rank's attention
shard, its EP rank's expert shard and its vocab rank's tail shard:

    weights/shared.safetensors        norms, bias_out (o_proj bias / tp), router, embedding, gamma
    weights/attn-tp{t}.safetensors    W_qkv, bias_qkv, W_out, sink           (one per TP rank)
    weights/expert-{r:03d}.safetensors  the rank's experts, all layers        (one per EP rank)
    weights/tail-v{v:03d}.safetensors lm_head_weight_t                       (one per vocab rank)

Tensor names are the kernels' argument names; per-layer tensors are stacked on a leading [L] axis.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .checkpoint.safetensors_io import TensorSpec
from .dtypes import dtype as dtype_of
from .errors import GkError
from .layout import attention, experts_mx, kv as kvlayout, tail, topology
from .layout.dims import MX_TILE, P_MAX, Dims
from .model import GptOssConfig
from .recipe import Recipe

ROLES = ("shared", "attn", "expert", "tail")


def arg_specs(d: Dims, experts: str) -> dict[str, list[TensorSpec]]:
    """The stored tensors of each file role (shapes for one file of that role)."""
    L, Hp, Ip, E_L = d.L, d.Hp, d.Ip, d.E_L
    T = TensorSpec
    shared = [
        T("input_layernorm_weight", "bf16", (L, 1, Hp)),
        T("post_attn_layernorm_weight", "bf16", (L, 1, Hp)),
        T("bias_out", "bf16", (L, 1, Hp)),
        T("router_weights", "fp16", (L, Hp, d.E)),
        T("router_bias", "fp16", (L, 1, d.E)),
        T("embed_tokens", "bf16", (d.V, Hp)),
        T("gamma", "fp32", (1, Hp)),
    ]
    qkv = (d.q_l + 2 * d.kv_l) * d.d
    attn = [
        T("W_qkv", "bf16", (L, Hp, qkv)),
        T("bias_qkv", "bf16", (L, 1, qkv)),
        T("W_out", "bf16", (L, d.q_l * d.d, Hp)),
        T("sink", "bf16", (L, d.q_l, 1)),
    ]
    if experts == "mxfp4":
        nht, nit = Hp // MX_TILE, Ip // MX_TILE
        expert = [
            T("expert_gate_up_weights", "u16", (L, E_L, P_MAX, 2, nht, Ip)),
            T("expert_gate_up_weights_scale", "u8", (L, E_L, 16, 2, nht, Ip)),
            T("expert_gate_up_bias", "fp32", (L, E_L, d.P_I, 2, nit, 4)),
            T("expert_down_weights", "u16", (L, E_L, d.P_I, nit, Hp)),
            T("expert_down_weights_scale", "u8", (L, E_L, d.P_I // 8, nit, Hp)),
            T("expert_down_bias", "fp32", (L, E_L, Hp)),
        ]
    else:
        expert = [
            T("expert_gate_up_weights", "bf16", (L, E_L, Hp, 2, Ip)),
            T("expert_gate_up_bias", "fp32", (L, E_L, 2, Ip)),
            T("expert_down_weights", "bf16", (L, E_L, Ip, Hp)),
            T("expert_down_bias", "fp32", (L, E_L, Hp)),
        ]
    return {"shared": shared, "attn": attn, "expert": expert, "tail": [T("lm_head_weight_t", "bf16", (Hp, d.V_s))]}


@dataclass(frozen=True)
class ShardFile:
    path: str
    role: str
    index: int  # TP rank, EP rank or vocab rank (0 for shared)
    tensors: tuple[TensorSpec, ...]
    ranks: tuple[int, ...]  # ranks that load it

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def shard_path(role: str, index: int) -> str:
    return {"shared": "weights/shared.safetensors", "attn": f"weights/attn-tp{index}.safetensors",
            "expert": f"weights/expert-{index:03d}.safetensors",
            "tail": f"weights/tail-v{index:03d}.safetensors"}[role]


@dataclass
class Plan:
    recipe: Recipe
    config: GptOssConfig
    dims: Dims
    files: list[ShardFile]
    ranks: list[topology.RankCoord]
    kv: kvlayout.KvLayout
    scalars: dict
    tail: dict
    meshes: dict
    budget: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.ranks)

    def files_of(self, rank: int) -> list[ShardFile]:
        return [f for f in self.files if rank in f.ranks]

    def rank_tensors(self, rank: int) -> dict[str, tuple[str, TensorSpec]]:
        """argument name -> (file path, spec) for one rank."""
        return {t.name: (f.path, t) for f in self.files_of(rank) for t in f.tensors}

    def weight_bytes(self, rank: int) -> int:
        return sum(f.nbytes for f in self.files_of(rank))

    @property
    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def to_json(self) -> dict:
        r0 = self.rank_tensors(0)
        by_role: dict[str, dict] = {}
        for f in self.files:
            e = by_role.setdefault(f.role, {"files": 0, "bytes_per_file": f.nbytes, "ranks_per_file": len(f.ranks),
                                            "tensors": {t.name: {"shape": list(t.shape), "dtype": t.dtype}
                                                        for t in f.tensors}})
            e["files"] += 1
        return {
            "recipe": self.recipe.name,
            "target": self.recipe.target,
            "ranks": self.world,
            "topology": {"tp": self.recipe.topology.tp, "dp": self.recipe.topology.dp,
                         "ep": self.recipe.topology.ep, "lnc": self.recipe.topology.lnc,
                         "vtp": self.recipe.topology.vtp},
            "rank_tensors": {n: {"shape": list(s.shape), "dtype": s.dtype, "file": p} for n, (p, s) in r0.items()},
            "files": by_role,
            "bytes_per_rank": self.weight_bytes(0),
            "disk_bytes": self.disk_bytes,
            "kv": {"form": self.kv.form, "entries": self.kv.entries, "num_blocks": self.kv.num_blocks,
                   "block_size": self.kv.block_size, "kv_heads_per_rank": self.kv.kv_heads, "dtype": self.kv.dtype,
                   "packed": self.kv.packed, "allocation_shape": self.kv.allocation_shape,
                   "allocations": self.kv.allocations, "k_entry_shape": self.kv.k_block_shape,
                   "bytes_per_rank": self.kv.bytes_per_rank, "dma": self.kv.dma_check(), "budget": self.budget},
            "tail": {"vocab_per_rank": self.dims.V_s, "hops": self.tail["hops"], "k": self.recipe.tail.k},
            "scalars": self.scalars,
        }


def make_plan(recipe: Recipe, cfg: GptOssConfig) -> Plan:
    """The whole plan; raises GkError for a topology the model or the memory cannot take."""
    recipe.check_against(cfg)
    t = recipe.topology
    d = Dims.of(cfg, tp=t.tp, ep=t.ep, vtp=t.vtp)
    ranks = [topology.coords(r, t.tp, t.vtp) for r in range(t.world)]
    specs = arg_specs(d, recipe.experts)
    counts = {"shared": 1, "attn": t.tp, "expert": t.ep, "tail": t.vtp}
    member = {"shared": lambda c, i: True, "attn": lambda c, i: c.tp == i,
              "expert": lambda c, i: c.ep == i, "tail": lambda c, i: c.vtp == i}
    files = [ShardFile(shard_path(role, i), role, i, tuple(specs[role]),
                       tuple(c.rank for c in ranks if member[role](c, i)))
             for role in ROLES for i in range(counts[role])]
    kvc = recipe.kv_cache
    where = recipe.path or "recipe"
    kv = kvlayout.KvLayout(form=kvc.form, num_layers=cfg.L, num_blocks=kvc.num_blocks or 1, kv_heads=d.kv_l,
                           block_size=kvc.block_size, head_dim=cfg.d, dtype=recipe.kv_dtype,
                           itemsize=dtype_of(recipe.kv_dtype).itemsize, packed=kvc.packed)
    cap = kv.max_num_blocks()
    weights = sum(f.nbytes for f in files if 0 in f.ranks)
    if kvc.num_blocks is None:
        usable = kvc.hbm_per_rank_gib * 2**30 * kvc.memory_utilization
        fit = kvlayout.budget_blocks(kv.entries * 2 * kv.block_bytes, usable, weights, where)
        budget = {"mode": "hbm", "hbm_per_rank_bytes": int(kvc.hbm_per_rank_gib * 2**30),
                  "usable_bytes": int(usable), "weight_bytes": weights, "fits_blocks": fit,
                  "dma_cap_blocks": cap, "capped_by_dma": fit > cap}
        kv = dataclasses.replace(kv, num_blocks=min(fit, cap))
    else:
        budget = {"mode": "given", "weight_bytes": weights, "dma_cap_blocks": cap}
        if kvc.num_blocks > cap:
            lift = (f"; kv_cache.form: per_buffer lifts it to {kv.max_num_blocks('per_buffer'):,}"
                    if kvc.form == "stacked" else "")
            raise GkError(f"{where}: kv_cache.num_blocks: {kvc.num_blocks:,} blocks exceed the uint32 DMA offset cap "
                          f"of {cap:,} for the {kvc.form} form (2^32 / ({kv.dma_span_entries} entries x "
                          f"{kv.block_bytes} bytes a block)){lift}")
    fp8 = kvc.dtype == "fp8"
    scalars = {
        "num_layers": cfg.L, "tp_size": t.tp, "ep_size": t.ep, "top_k": cfg.top_k,
        "eps": cfg.rms_norm_eps, "hidden_actual": cfg.H, "hidden_padded": d.Hp,
        "softmax_scale": attention.softmax_scale(cfg.d, kvc.k_scale if fp8 else 1.0),
        **experts_mx.clamps(cfg.swiglu_limit),
        "k_scale": 1.0 / kvc.k_scale if fp8 else None, "v_scale": 1.0 / kvc.v_scale if fp8 else None,
        "sliding_window": cfg.sliding_window,
        # block-table widths, compile-time shapes: the full table spans max_context tokens; the
        # trimmed sliding table the blocks a window of W-1 prior tokens can touch
        "full_table_blocks": -(-recipe.decode.max_context // kvc.block_size),
        "swa_table_blocks": -(-(cfg.sliding_window - 1) // kvc.block_size) + 1,
        "rope": {"theta": cfg.rope.theta, "factor": cfg.rope.factor, "beta_fast": cfg.rope.beta_fast,
                 "beta_slow": cfg.rope.beta_slow,
                 "original_max_position_embeddings": cfg.rope.original_max_position_embeddings,
                 "truncate": cfg.rope.truncate, "concentration": cfg.rope.concentration},
        "batch": {str(b): {"B": b, "B_attn": b // t.dp, "T_shard": b // t.world, "T_ep": b, "R": b // t.vtp}
                  for b in recipe.decode.batch_sizes},
    }
    hops = recipe.hops
    tail_meta = {"vtp": t.vtp, "vocab_per_rank": d.V_s, "hops": hops, "k": recipe.tail.k,
                 "emit_logits": recipe.tail.emit_logits, "a2a_batch_groups": t.a2a_batch_groups,
                 "hop_meshes": tail.compose_hops(t.vtp, hops)}
    meshes = {"tp_replica_group": topology.tp_mesh(t.tp, t.dp), "ep_replica_group": topology.ep_mesh(t.world)}
    return Plan(recipe, cfg, d, files, ranks, kv, scalars, tail_meta, meshes, budget)
