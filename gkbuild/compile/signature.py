"""The input and output signatures of the two compiled programs, for one rank.

Both backends compile these: the inductor backend the torch twins, the neuron backend the NKI
kernels. Every input says what it is: a weight (and the shard file it comes from), a KV buffer, a
per-step control input, or an activation. ``"batch"`` marks the dynamic batch dimension.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..dtypes import dtype as gk_dtype

TAIL_WEIGHTS = ("gamma", "lm_head_weight_t")
NOT_DECODE = ("embed_tokens",) + TAIL_WEIGHTS  # the runtime embeds; the tail has its own program


@dataclass(frozen=True)
class Input:
    name: str
    shape: tuple  # ints, or "batch"
    dtype: str  # torch dtype name
    kind: str  # activation | control | weight | kv_buffer
    file: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        if self.file is None:
            d.pop("file")
        return d


@dataclass(frozen=True)
class Signature:
    program: str  # decode | tail
    inputs: tuple[Input, ...]
    outputs: tuple[dict, ...]

    def names(self, kind: str | None = None) -> list[str]:
        return [i.name for i in self.inputs if kind is None or i.kind == kind]


def _torch_name(gk: str) -> str:
    return gk_dtype(gk).torch


def kv_torch_dtype(kv_dtype: str) -> str:
    """Both FP8 formats are carried as float8_e4m3fn (same bits below e4m3's max of 240)."""
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
    weights = [Input(t.name, tuple(t.shape), _torch_name(t.dtype), "weight", f.path)
               for f in plan.files_of(0) for t in f.tensors if t.name not in NOT_DECODE]
    k_shape = tuple(kv.k_packed_shape) if kv.packed else tuple(kv.buffer_shape[1:])
    tdt = kv_torch_dtype(kv.dtype)
    bufs = [Input(f"K_cache_{g}", k_shape, tdt, "kv_buffer") for g in range(kv.groups)]
    bufs += [Input(f"V_cache_{g}", tuple(kv.buffer_shape[1:]), tdt, "kv_buffer") for g in range(kv.groups)]
    outputs = ({"name": "x_out", "shape": [B, d.Hp], "dtype": "float32"},
               {"name": "hidden_states", "shape": [L, B, d.Hp], "dtype": "float32"})
    return Signature("decode", tuple(act + ctl + weights + bufs), outputs)


def tail(plan) -> Signature:
    d, k = plan.dims, plan.recipe.tail.k
    B = "batch"
    files = {t.name: f.path for f in plan.files_of(0) for t in f.tensors}
    specs = {t.name: t for f in plan.files_of(0) for t in f.tensors}
    inputs = [Input("hidden", (B, d.Hp), "float32", "activation"),
              Input("sampling_params", (B, 3), "float32", "control")]
    inputs += [Input(n, tuple(specs[n].shape), _torch_name(specs[n].dtype), "weight", files[n]) for n in TAIL_WEIGHTS]
    outputs = [{"name": "tokens", "shape": [B], "dtype": "int64"},
               {"name": "topk_values", "shape": [B, k], "dtype": "float32"},
               {"name": "topk_indices", "shape": [B, k], "dtype": "int64"}]
    if plan.recipe.tail.emit_logits:
        outputs.append({"name": "logits", "shape": [B, d.V_s], "dtype": "float32"})
    return Signature("tail", tuple(inputs), tuple(outputs))
