"""The input and output signatures of the compiled programs, one rank's view.

Two families, derived here once and used by the trace, the manifest, the driver and the runtime:

- **Neuron programs** (trn2/trn3): what the published kernels take, under their own argument names,
  with each rank's static shapes, one program per decode batch size (NEFF shapes are static).
  The decode program is ``gpt_oss_decode_mega_kernel`` (nki-library
  ``models/gpt_oss/c128_giga_kernel/experimental/gpt_oss/gpt_oss_decode_layer_dp_tp_ep.py``, A or
  the fork F): its parameter order, ``x_shard`` [B/(DP*TP), Hp], the stacked weights, K/V in the
  recipe's form, layer-invariant control over the replica's B_attn = B/DP tokens (cos/sin
  [d/2, B_attn, 1], int32 block tables with -1 for unused slots, the uint8 active-token mask,
  float32 positions, uint32 update slots where uint32 max means skip), ``rank_id`` [1, 1] uint32,
  the FP8 quantize multipliers ``k_scale``/``v_scale`` [1, 1] fp32 (passing them is what turns FP8
  KV on), and F's optional forms (``kv_cache_update_idx_swa``, ``embed_*``, ``inv_freq`` +
  ``rope_concentration``). The tail is ``gpt_oss_tail_chunked_megakernel``: ``hidden_states``
  [B, Hp] (every rank sees the batch), ``sampling_params`` [B/VTP, 3|4] (this rank's rows only),
  outputs in the kernel's order. Each program's argument set is held to its revision's committed
  interface (``conformance``) before anything is traced.
- **Inductor programs** (cpu/cuda, world size 1): the torch twins' own signature with one dynamic
  ``"batch"`` dimension, one program each for decode and tail.

Every input says what it is: ``weight`` (with the shard file rank 0 reads it from; rank r reads
its own, ``ranks[r].loads``), ``kv_buffer``, ``control`` (built by the runtime each step),
``activation``, ``constant`` (fixed by the build: ``value``) or ``rank`` (fixed per rank by its
coordinates: ``rank_id``, ``embed_x_shard_ids``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..dtypes import dtype as gk_dtype

TAIL_WEIGHTS = ("gamma", "lm_head_weight_t")
FUSED = ("embed_weight", "inv_freq")  # device-side embedding / RoPE: placed in the kernel's parameter order
NOT_DECODE = TAIL_WEIGHTS + FUSED  # the tail has its own program
ACTIVATION = "bfloat16"  # the decode residual stream (the kernel refuses fp32 queries with FP8 KV)
UINT32_SKIP = 0xFFFFFFFF  # an update slot of uint32 max: this row writes nothing
# The decode kernel's weight parameters, in its order (the public MXFP4 entry point).
DECODE_WEIGHTS = ("input_layernorm_weight", "W_qkv", "bias_qkv", "W_out", "bias_out", "sink",
                  "post_attn_layernorm_weight", "router_weights", "router_bias", "expert_gate_up_weights",
                  "expert_down_weights", "expert_gate_up_weights_scale", "expert_down_weights_scale",
                  "expert_gate_up_bias", "expert_down_bias")


@dataclass(frozen=True)
class Input:
    name: str
    shape: tuple  # ints, or "batch" for the inductor programs' dynamic dimension
    dtype: str  # the kernel's / torch's dtype name
    kind: str  # activation | control | weight | kv_buffer | constant | rank
    file: str | None = None
    value: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        for k in ("file", "value"):
            if d[k] is None:
                d.pop(k)
        return d


@dataclass(frozen=True)
class Signature:
    program: str  # decode | tail
    inputs: tuple[Input, ...]
    outputs: tuple[dict, ...]
    batch: int | None = None  # the static global batch (Neuron programs); None: dynamic
    scalars: dict = field(default_factory=dict)  # the kernel's non-tensor arguments

    @property
    def key(self) -> str:
        """The artifact's name: decode / tail, or decode-b128 for a static batch."""
        return self.program if self.batch is None else f"{self.program}-b{self.batch}"

    def names(self, kind: str | None = None) -> list[str]:
        return [i.name for i in self.inputs if kind is None or i.kind == kind]

    def input(self, name: str) -> Input:
        return next(i for i in self.inputs if i.name == name)


def programs(plan) -> list[Signature]:
    """Every program a build compiles, in order."""
    if plan.recipe.backend == "inductor":
        return [decode(plan), tail(plan)]
    return [s for b in plan.recipe.decode.batch_sizes for s in (neuron_decode(plan, b), neuron_tail(plan, b))]


# -- Neuron programs ---------------------------------------------------------------------------------
def kv_dtype_name(kv_dtype: str) -> str:
    """The torch dtype K/V are carried in: both FP8 formats as float8_e4m3fn. trn3 takes it
    natively; on trn2 (no F8E4M3FN, NCC_EVRF051) the bytes hold values saturated at +-240, whose bit
    patterns are IEEE e4m3's, and the decode compiles with ``--experimental-unsafe-fp8e4m3fn-as-fp8e4m3``."""
    return {"bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e4m3fn": "float8_e4m3fn"}[kv_dtype]


def _weights(plan, names, extras: bool = True) -> list[Input]:
    """Rank 0's weights named ``names``, in that order, then (``extras``) any other decode weight."""
    have = {t.name: (f.path, t) for f in plan.files_of(0) for t in f.tensors}
    ordered = [n for n in names if n in have]
    if extras:
        ordered += sorted(n for n in have if n not in names and n not in NOT_DECODE)
    return [Input(n, tuple(have[n][1].shape), gk_dtype(have[n][1].dtype).torch, "weight", have[n][0])
            for n in ordered]


def kv_inputs(kv) -> list[Input]:
    """K_cache and V_cache in the plan's form: [entries, ...] (L stacked, ceil(L/2) paired)."""
    dt = kv_dtype_name(kv.dtype)
    return [Input("K_cache", (kv.entries, *kv.k_block_shape), dt, "kv_buffer"),
            Input("V_cache", (kv.entries, *kv.block_shape), dt, "kv_buffer")]


def _decode_order() -> list[str]:
    """The decode kernel's parameter order, from the fork F's committed interface (a superset of A's,
    in the same order): the order a program's inputs and scalars are listed in."""
    from .interface import load
    from .kernel_source import F

    repo, _, commit = F.partition("@")
    return [p["name"] for p in load(repo, commit)["entries"]["gpt_oss_decode_mega_kernel"]["params"]]


def neuron_decode(plan, batch: int) -> Signature:
    """One rank's ``gpt_oss_decode_mega_kernel`` arguments for a global batch (CONTRACT.md section 6).
    Every form passes x_shard (the fused embedding reads its shape and dtype) and cos/sin (fused RoPE
    writes its tables in their dtype); the optional forms add their own arguments."""
    s, kv, d, t = plan.scalars, plan.kv, plan.dims, plan.recipe.topology
    L, half = plan.config.L, plan.config.d // 2
    T, B_attn = batch // t.world, batch // t.dp
    heads = (kv.kv_heads,) if kv.kv_heads > 1 else ()  # per-head tables and slots when a rank holds several
    ins = {i.name: i for i in _weights(plan, DECODE_WEIGHTS)}
    ins.update({i.name: i for i in kv_inputs(kv)})
    ins["x_shard"] = Input("x_shard", (T, d.Hp), ACTIVATION, "activation")
    for i in (Input("swa_start_pos_ids", (L, B_attn, 1), "float32", "control"),
              Input("cos", (half, B_attn, 1), "float32", "control"),
              Input("sin", (half, B_attn, 1), "float32", "control"),
              Input("active_blocks_table", (B_attn, *heads, s["full_table_blocks"]), "int32", "control"),
              Input("active_blocks_table_swa", (B_attn, *heads, s["swa_table_blocks"]), "int32", "control"),
              Input("attention_mask", (1, B_attn, d.q_l, 1), "uint8", "control"),
              Input("kv_cache_update_idx", (B_attn, *heads, 1), "uint32", "control"),
              Input("pos_ids", (B_attn, 1), "float32", "control"),
              Input("pos_ids_swa", (B_attn, 1), "float32", "control"),
              Input("rank_id", (1, 1), "uint32", "rank")):
        ins[i.name] = i
    if "swa" in kv.update_indices:  # paired: a pair's sliding layer writes its own blocks
        ins["kv_cache_update_idx_swa"] = Input("kv_cache_update_idx_swa", (B_attn, *heads, 1), "uint32", "control")
    if s["k_scale"] is not None:
        ins["k_scale"] = Input("k_scale", (1, 1), "float32", "constant", value=s["k_scale"])
        ins["v_scale"] = Input("v_scale", (1, 1), "float32", "constant", value=s["v_scale"])
    fused = {f["name"]: f for f in plan.fused_inputs(0)}
    for name, f in fused.items():
        if f["kind"] == "weight":
            ins[name] = Input(name, tuple(f["shape"]), gk_dtype(f["dtype"]).torch, "weight", f["file"])
    if "embed_ids" in fused:
        ins["embed_ids"] = Input("embed_ids", (B_attn,), "int32", "control")
    if "embed_x_shard_ids" in fused:
        ins["embed_x_shard_ids"] = Input("embed_x_shard_ids", (T,), "int32", "rank")
    scalars = {"tp_replica_group": plan.meshes["tp_replica_group"],
               "ep_replica_group": plan.meshes["ep_replica_group"],
               "num_layers": L, "tp_size": s["tp_size"], "ep_size": s["ep_size"], "B_attn": B_attn, "S_tkg": 1,
               "top_k": s["top_k"], "eps": s["eps"], "hidden_actual": s["hidden_actual"],
               "softmax_scale": s["softmax_scale"], "gate_clamp_upper_limit": s["gate_clamp_upper_limit"],
               "up_clamp_upper_limit": s["up_clamp_upper_limit"], "up_clamp_lower_limit": s["up_clamp_lower_limit"]}
    if "rope_concentration" in fused:
        scalars["rope_concentration"] = fused["rope_concentration"]["value"]
    order = {n: k for k, n in enumerate(_decode_order())}
    inputs = sorted(ins.values(), key=lambda i: order.get(i.name, len(order)))
    outputs = [{"name": "x_shard", "shape": [T, d.Hp], "dtype": ACTIVATION}]
    outputs += [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype, "aliases": i.name}
                for i in inputs if i.kind == "kv_buffer"]
    scalars = dict(sorted(scalars.items(), key=lambda kv_: order.get(kv_[0], len(order))))
    return Signature("decode", tuple(inputs), tuple(outputs), batch, scalars)


def neuron_tail(plan, batch: int) -> Signature:
    d, r = plan.dims, plan.recipe
    R = batch // r.topology.vtp
    inputs = [Input("hidden_states", (batch, d.Hp), ACTIVATION, "activation"), *_weights(plan, TAIL_WEIGHTS, False)]
    inputs.append(Input("sampling_params", (R, 4 if r.tail.runtime_draw else 3), "float32", "control"))
    k = r.tail.k
    outputs = [{"name": "topk_values", "shape": [R, k], "dtype": "bfloat16"},
               {"name": "topk_indices", "shape": [R, k], "dtype": "uint32"},
               {"name": "tokens", "shape": [R, 1], "dtype": "uint32"}]
    if r.tail.emit_logits:
        outputs.insert(0, {"name": "logits", "shape": [batch, d.V_s], "dtype": "float32"})
    scalars = {"eps": plan.scalars["eps"], "hidden_actual": plan.scalars["hidden_actual"],
               "zero_interleaved_pad": True, "k": k, "hop_meshes": plan.tail["hop_meshes"],
               "emit_logits": r.tail.emit_logits, "a2a_batch_groups": r.topology.a2a_batch_groups}
    return Signature("tail", tuple(inputs), tuple(outputs), batch, scalars)


# -- Inductor programs (the twins, world size 1) ---------------------------------------------------------
def kv_torch_dtype(kv_dtype: str) -> str:
    """Both FP8 formats are carried as float8_e4m3fn (same bits within e4m3's max of 240)."""
    return "bfloat16" if kv_dtype == "bf16" else "float8_e4m3fn"


def decode(plan) -> Signature:
    s, kv, d = plan.scalars, plan.kv, plan.dims
    B, L = "batch", plan.config.L
    act = [Input("x", (B, d.Hp), "float32", "activation")]
    ctl = [
        Input("cos", (B, plan.config.d // 2), "float32", "control"),
        Input("sin", (B, plan.config.d // 2), "float32", "control"),
        Input("block_table", (B, s["full_table_blocks"]), "int64", "control"),
        Input("block_table_swa", (B, s["swa_table_blocks"]), "int64", "control"),
        Input("pos", (B,), "int64", "control"),
        Input("pos_swa", (B,), "int64", "control"),
        Input("swa_start", (L, B), "int64", "control"),
        Input("update_idx", (B,), "int64", "control"),
        Input("update_idx_swa", (B,), "int64", "control"),
    ]
    weights = _weights(plan, DECODE_WEIGHTS)
    tdt = kv_torch_dtype(kv.dtype)
    bufs = [Input(i.name, i.shape, tdt, "kv_buffer") for i in kv_inputs(kv)]
    outputs = ({"name": "x_out", "shape": [B, d.Hp], "dtype": "float32"},
               {"name": "hidden_states", "shape": [L, B, d.Hp], "dtype": "float32"})
    return Signature("decode", tuple(act + ctl + weights + bufs), outputs)


def tail(plan) -> Signature:
    d, k = plan.dims, plan.recipe.tail.k
    B = "batch"
    inputs = [Input("hidden", (B, d.Hp), "float32", "activation"),
              Input("sampling_params", (B, 3), "float32", "control")]
    inputs += _weights(plan, TAIL_WEIGHTS, False)
    outputs = [{"name": "tokens", "shape": [B], "dtype": "int64"},
               {"name": "topk_values", "shape": [B, k], "dtype": "float32"},
               {"name": "topk_indices", "shape": [B, k], "dtype": "int64"}]
    if plan.recipe.tail.emit_logits:
        outputs.append({"name": "logits", "shape": [B, d.V_s], "dtype": "float32"})
    return Signature("tail", tuple(inputs), tuple(outputs))
