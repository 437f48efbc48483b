"""The layout plan: for a recipe and a model config, every rank's tensors, files, bytes and the KV
budget, computed before any weight is read. Pure: no I/O.

Files are unique shards named by role; a rank's device loads the shared file, its TP rank's
attention shard, its EP rank's expert shard, its vocab rank's tail shard and, where the kernel
embeds (``decode.embedding`` vocab or hidden), its embedding shard:

    weights/shared.safetensors        norms, bias_out (o_proj bias / tp), router, gamma (+ inv_freq)
    weights/attn-tp{t}.safetensors    W_qkv, bias_qkv, W_out, sink           (one per TP rank)
    weights/expert-{r:03d}.safetensors  the rank's experts, all layers        (one per EP rank)
    weights/tail-v{v:03d}.safetensors lm_head_weight_t                       (one per vocab rank)
    weights/embed-host.safetensors    embed_tokens [V, Hp], host-side: the runtime embeds (host)
    weights/embed-vocab-tp{t}.safetensors embed_weight [V/TP, Hp]            (vocab: one per TP rank)
    weights/embed-tp{t}.safetensors   embed_weight [V, Hp/TP]                (hidden: one per TP rank)

Tensor names are the kernels' argument names; per-layer tensors are stacked on a leading [L] axis.
A file is either read by device programs (it counts against the ranks' device memory) or used on
the host by the runtime (``ShardFile.device`` False): budgets count only the device side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .checkpoint.safetensors_io import TensorSpec
from .dtypes import dtype as dtype_of
from .errors import GkError
from .layout import kv as kvlayout, tail, topology
from .layout.dims import MX_TILE, P_MAX, Dims
from .layout.scalars import clamps, softmax_scale, vocab_rows
from .model import GptOssConfig
from .recipe import Recipe

ROLES = ("shared", "attn", "expert", "tail", "embed")


def arg_specs(d: Dims, experts: str, embed: str = "host", rope: str = "host") -> dict[str, list[TensorSpec]]:
    """The stored tensors of each file role (shapes for one file of that role)."""
    L, Hp, Ip, E_L = d.L, d.Hp, d.Ip, d.E_L
    T = TensorSpec
    shared = [
        T("input_layernorm_weight", "bf16", (L, 1, Hp)),
        T("post_attn_layernorm_weight", "bf16", (L, 1, Hp)),
        T("bias_out", "bf16", (L, 1, Hp)),
        T("router_weights", "fp16", (L, Hp, d.E)),
        T("router_bias", "fp16", (L, 1, d.E)),
        T("gamma", "fp32", (1, Hp)),
    ] + ([T("inv_freq", "fp32", (d.d // 2, 1))] if rope == "fused" else [])
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
    embed = {"host": T("embed_tokens", "bf16", (d.V, Hp)),
             "vocab": T("embed_weight", "bf16", (vocab_rows(d.V, d.tp), Hp)),
             "hidden": T("embed_weight", "bf16", (d.V, Hp // d.tp))}[embed]
    return {"shared": shared, "attn": attn, "expert": expert, "tail": [T("lm_head_weight_t", "bf16", (Hp, d.V_s))],
            "embed": [embed]}


@dataclass(frozen=True)
class ShardFile:
    path: str
    role: str
    index: int  # TP rank, EP rank or vocab rank (0 for shared)
    tensors: tuple[TensorSpec, ...]
    ranks: tuple[int, ...]  # ranks whose programs use it
    device: bool = True  # False: the runtime uses it on the host; it never goes to device memory

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def shard_path(role: str, index: int, embed: str = "host") -> str:
    if role == "embed":
        return {"host": "weights/embed-host.safetensors", "vocab": f"weights/embed-vocab-tp{index}.safetensors",
                "hidden": f"weights/embed-tp{index}.safetensors"}[embed]
    return {"shared": "weights/shared.safetensors", "attn": f"weights/attn-tp{index}.safetensors",
            "expert": f"weights/expert-{index:03d}.safetensors",
            "tail": f"weights/tail-v{index:03d}.safetensors"}[role]


def group_ranks(items) -> list[dict]:
    """(rank, figures) pairs -> [{"ranks": [...], **figures}], ranks with equal figures merged."""
    import json

    groups: dict[str, dict] = {}
    for rank, figures in items:
        groups.setdefault(json.dumps(figures, sort_keys=True), {"ranks": [], **figures})["ranks"].append(rank)
    return list(groups.values())


def rank_ranges(ranks) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8': a set of ranks as a user reads it."""
    ranks, out = sorted(ranks), []
    for r in ranks:
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


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
        """The files a rank's device programs read: its device load set."""
        return [f for f in self.files if f.device and rank in f.ranks]

    @property
    def host_files(self) -> list[ShardFile]:
        """Files the runtime uses on the host (never loaded to a device)."""
        return [f for f in self.files if not f.device]

    def rank_tensors(self, rank: int) -> dict[str, tuple[str, TensorSpec]]:
        """argument name -> (file path, spec) for one rank's device programs."""
        return {t.name: (f.path, t) for f in self.files_of(rank) for t in f.tensors}

    def weight_bytes(self, rank: int) -> int:
        """Device bytes of the weights a rank's programs read."""
        return sum(f.nbytes for f in self.files_of(rank))

    def host_entries(self) -> list[dict]:
        """The host-side files as the manifest lists them, apart from the ranks' device loads."""
        return [{"file": f.path, "tensors": [t.name for t in f.tensors], "program": "decode",
                 "use": "the runtime embeds: x_shard = embed_tokens[token ids], each rank's own tokens"}
                for f in self.host_files]

    @property
    def host_bytes(self) -> int:
        return sum(f.nbytes for f in self.host_files)

    @property
    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def device_memory(self, rank: int) -> dict:
        """What one rank's device holds: weights by file role, the KV buffers, the reserve."""
        by_role: dict[str, int] = {}
        for f in self.files_of(rank):
            by_role[f.role] = by_role.get(f.role, 0) + f.nbytes
        weights = sum(by_role.values())
        reserve = self.budget["reserve_bytes"]
        return {"weights_by_role": by_role, "weights_bytes": weights, "kv_bytes": self.kv.bytes_per_rank,
                "reserve_bytes": reserve, "total_bytes": weights + self.kv.bytes_per_rank + reserve}

    def device_memory_groups(self) -> list[dict]:
        """``device_memory`` of every rank, ranks with the same figures merged: [{ranks, ...}]."""
        return group_ranks((c.rank, self.device_memory(c.rank)) for c in self.ranks)

    def fused_inputs(self, rank: int) -> list[dict]:
        """The device-side embedding and RoPE inputs of one rank's decode, in the kernel's names
        (CONTRACT.md section 6), each with what it replaces: what a Neuron signature adds for
        ``decode.embedding`` vocab | hidden and ``decode.rope`` fused. Shapes use B (global batch)
        and B_attn (a DP replica's tokens); ``scalars.batch`` gives them for each batch size."""
        out = []
        emb = self.recipe.decode.embedding
        if emb != "host":
            (path, spec), = [(f.path, t) for f in self.files_of(rank) if f.role == "embed" for t in f.tensors]
            c = self.ranks[rank]
            rule = (f"this DP replica's tokens: global id g -> g - {c.tp}*{spec.shape[0]} if TP rank {c.tp} owns it "
                    f"(rows [{c.tp * spec.shape[0]}, {(c.tp + 1) * spec.shape[0]})) else -1; the partial rows are "
                    f"summed by reduce-scatter + all-gather over tp_replica_group"
                    if emb == "vocab" else
                    f"global ids of this DP replica's tokens; TP rank {c.tp} holds hidden lanes "
                    f"[{c.tp * spec.shape[1]}, {(c.tp + 1) * spec.shape[1]}), all-gathered over tp_replica_group")
            out += [{"name": "embed_weight", "kind": "weight", "shape": list(spec.shape), "dtype": spec.dtype,
                     "file": path, "fills": "x_shard"},
                    {"name": "embed_ids", "kind": "control", "shape": ["B_attn"], "dtype": "i32", "rule": rule,
                     "fills": "x_shard"}]
            if emb == "hidden":
                out.append({"name": "embed_x_shard_ids", "kind": "rank", "shape": ["T_shard"], "dtype": "i32",
                            "rule": f"this rank's rows of the replica: {c.tp}*T_shard + arange(T_shard)",
                            "fills": "x_shard"})
        if self.recipe.decode.rope == "fused":
            (path, spec), = [(f.path, t) for f in self.files_of(rank) for t in f.tensors if t.name == "inv_freq"]
            out += [{"name": "inv_freq", "kind": "weight", "shape": list(spec.shape), "dtype": spec.dtype,
                     "file": path, "fills": "cos, sin (still passed: the kernel takes their dtype)"},
                    {"name": "rope_concentration", "kind": "scalar", "value": self.scalars["rope_concentration"],
                     "fills": "cos, sin (still passed: the kernel takes their dtype)"}]
        return out

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
            "host_files": [{**e, "bytes": f.nbytes} for e, f in zip(self.host_entries(), self.host_files)],
            "host_bytes": self.host_bytes,
            "disk_bytes": self.disk_bytes,
            "embedding": self.recipe.decode.embedding,
            "rope": self.recipe.decode.rope,
            "fused_inputs": self.fused_inputs(0),
            "device_memory": [{**g, "ranks": rank_ranges(g["ranks"])} for g in self.device_memory_groups()],
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
    emb = recipe.decode.embedding
    specs = arg_specs(d, recipe.experts, emb, recipe.decode.rope)
    counts = {"shared": 1, "attn": t.tp, "expert": t.ep, "tail": t.vtp, "embed": 1 if emb == "host" else t.tp}
    index_of = {"shared": lambda c: 0, "attn": lambda c: c.tp, "expert": lambda c: c.ep, "tail": lambda c: c.vtp,
                "embed": (lambda c: 0) if emb == "host" else (lambda c: c.tp)}
    holders: dict[tuple[str, int], list[int]] = {}  # (role, index) -> the ranks that load that file, in order
    for c in ranks:
        for role in ROLES:
            holders.setdefault((role, index_of[role](c)), []).append(c.rank)
    files = [ShardFile(shard_path(role, i, emb), role, i, tuple(specs[role]), tuple(holders.get((role, i), ())),
                       device=(role, emb) != ("embed", "host"))
             for role in ROLES for i in range(counts[role])]
    kvc = recipe.kv_cache
    where = recipe.path or "recipe"
    kv = kvlayout.KvLayout(form=kvc.form, num_layers=cfg.L, num_blocks=kvc.num_blocks or 1, kv_heads=d.kv_l,
                           block_size=kvc.block_size, head_dim=cfg.d, dtype=recipe.kv_dtype,
                           itemsize=dtype_of(recipe.kv_dtype).itemsize, packed=kvc.packed)
    cap = kv.max_num_blocks()
    on_device = dict.fromkeys((c.rank for c in ranks), 0)  # weight bytes each rank's device loads
    for f in files:
        if f.device:
            n = f.nbytes
            for r in f.ranks:
                on_device[r] += n
    weights = max(on_device.values())
    budget = kv_budget(recipe, kv.entries * 2 * kv.block_bytes, weights, sum(f.nbytes for f in files if not f.device),
                       cap)
    kv = dataclasses.replace(kv, num_blocks=budget["num_blocks"])
    if kvc.num_blocks is not None and kvc.num_blocks > cap:
        lift = (f"; kv_cache.form: paired lifts it to {kv.max_num_blocks('paired'):,}"
                if kvc.form == "stacked" else "")
        raise GkError(f"{where}: kv_cache.num_blocks: {kvc.num_blocks:,} blocks exceed the uint32 DMA offset cap "
                      f"of {cap:,} for the {kvc.form} form (2^32 / ({kv.dma_span_entries} entries x "
                      f"{kv.block_bytes} bytes a block)){lift}")
    fp8 = kvc.dtype == "fp8"
    scalars = {
        "num_layers": cfg.L, "tp_size": t.tp, "ep_size": t.ep, "top_k": cfg.top_k,
        "eps": cfg.rms_norm_eps, "hidden_actual": cfg.H, "hidden_padded": d.Hp,
        "softmax_scale": softmax_scale(cfg.d, kvc.k_scale if fp8 else 1.0),
        **clamps(cfg.swiglu_limit),
        "k_scale": 1.0 / kvc.k_scale if fp8 else None, "v_scale": 1.0 / kvc.v_scale if fp8 else None,
        "sliding_window": cfg.sliding_window,
        # block-table widths, compile-time shapes: the full table spans max_context tokens; the
        # trimmed sliding table the blocks a window of W-1 prior tokens can touch
        "full_table_blocks": -(-recipe.decode.max_context // kvc.block_size),
        "swa_table_blocks": -(-(cfg.sliding_window - 1) // kvc.block_size) + 1,
        "rope": {"theta": cfg.rope.theta, "factor": cfg.rope.factor, "beta_fast": cfg.rope.beta_fast,
                 "beta_slow": cfg.rope.beta_slow,
                 "original_max_position_embeddings": cfg.rope.original_max_position_embeddings,
                 "truncate": cfg.rope.truncate, "concentration": cfg.rope.concentration,
                 "mode": recipe.decode.rope},
        # the fused-RoPE kernel scalar (cos and sin are multiplied by it); None when the host passes cos/sin
        "rope_concentration": cfg.rope.concentration if recipe.decode.rope == "fused" else None,
        "embedding": {"placement": emb, **({"rows_per_rank": vocab_rows(d.V, t.tp)} if emb == "vocab"
                                           else {"lanes_per_rank": d.Hp // t.tp} if emb == "hidden" else {})},
        "batch": {str(b): {"B": b, "B_attn": b // t.dp, "T_shard": b // t.world, "T_ep": b, "R": b // t.vtp}
                  for b in recipe.decode.batch_sizes},
    }
    hops = recipe.hops
    tail_meta = {"vtp": t.vtp, "vocab_per_rank": d.V_s, "hops": hops, "k": recipe.tail.k,
                 "emit_logits": recipe.tail.emit_logits, "a2a_batch_groups": t.a2a_batch_groups,
                 "hop_meshes": tail.compose_hops(t.vtp, hops)}
    meshes = {"tp_replica_group": topology.tp_mesh(t.tp, t.dp), "ep_replica_group": topology.ep_mesh(t.world)}
    plan = Plan(recipe, cfg, d, files, ranks, kv, scalars, tail_meta, meshes, budget)
    if recipe.backend == "neuron":
        from .compile import conformance

        conformance.check(plan)
    return plan


def kv_budget(recipe: Recipe, per_block: int, device_weights: int, host_bytes: int, dma_cap: int) -> dict:
    """The KV budget's inputs and result. Budget mode: weights + KV fill at most
    hbm_per_rank x memory_utilization, and the reserve for the compiled programs and scratch must
    fit in what is left of the HBM (when it does not, it comes out of the KV); the uint32 DMA offset
    caps the blocks. Only device bytes count: host-side files (``host_bytes``) are reported, never
    charged."""
    kvc = recipe.kv_cache
    reserve = int(kvc.device_reserve_gib * 2**30)
    b = {"mode": "given" if kvc.num_blocks is not None else "hbm", "reserve_bytes": reserve,
         "device_weight_bytes": device_weights, "host_bytes": host_bytes, "per_block_bytes": per_block,
         "dma_cap_blocks": dma_cap}
    num_blocks = kvc.num_blocks
    if num_blocks is None:
        hbm = int(kvc.hbm_per_rank_gib * 2**30)
        usable = min(int(hbm * kvc.memory_utilization), hbm - reserve)
        fit = kvlayout.budget_blocks(per_block, usable, device_weights, reserve, recipe.path or "recipe")
        num_blocks = min(fit, dma_cap)
        b.update(hbm_per_rank_bytes=hbm, memory_utilization=kvc.memory_utilization, usable_bytes=usable,
                 fits_blocks=fit, capped_by_dma=fit > dma_cap)
    kv_bytes = num_blocks * per_block
    b.update(num_blocks=num_blocks, kv_bytes=kv_bytes, device_bytes=device_weights + kv_bytes + reserve)
    if "hbm_per_rank_bytes" in b:
        b["free_bytes"] = b["hbm_per_rank_bytes"] - b["device_bytes"]
    return b
