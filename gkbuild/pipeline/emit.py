"""Shard emission: one job writes one unique shard file, streaming.

A job reads only the source tensors its file needs, layer by layer, as zero-copy views of the
memory-mapped checkpoint, applies the pure layout functions, writes each layer's slice at its
offset in the stacked tensor, and drops the source pages it touched. So a worker holds one
layer of one shard at a time, whatever the model size. The file appears under its final name
only when complete (``SafetensorsStream``), with the sha256 of its bytes as they were written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checkpoint import mxfp4, names
from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import SafetensorsStream, TensorSpec
from ..dtypes import dtype
from ..layout import LAYOUT_VERSION, attention, embedding, experts_bf16, experts_mx, replicated, scalars, tail
from ..layout.dims import Dims
from ..paths import inside
from .fingerprint import sha256_file

EMBED_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class Context:
    """What every job of one build shares (sent once to each worker)."""

    ckpt_root: str
    out_dir: str
    dims: Dims
    experts: str
    v_scale: float
    embedding: str = "host"  # decode.embedding: host | vocab | hidden (the latter two split over TP)
    rope: dict | None = None  # the model's YaRN parameters when decode.rope is fused (writes inv_freq)
    scale_rule: str | None = None  # a dense source's experts quantized so (``checkpoint.quantized``); None: MXFP4


@dataclass(frozen=True)
class ShardJob:
    role: str
    index: int
    path: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


_ck: dict[str, Checkpoint] = {}
_progress = None


def init_worker(progress_queue) -> None:
    """Pool initializer: die with the parent (no orphan keeps writing after a kill)."""
    global _progress
    _progress = progress_queue
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        # Keep freed relayout buffers (up to 32 MiB each) in the heap for the next layer: fresh
        # mmap'd ones had every page faulted in and zeroed again, 10% of a build's CPU.
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (its maximum)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def _report(n: int, task: str = "shards") -> None:
    if _progress is not None:
        _progress.put((task, n))


def use_checkpoint(root: str, ck) -> None:
    """Serve ``root`` from ``ck`` in this process (a streamed build's checkpoint read by range)."""
    _ck[root] = ck


def _checkpoint(ctx: Context):
    """The build's source, as MXFP4: a folder mapped, or a source read by range (``ranged.connect``);
    a dense one through the ``Quantized`` view with the build's scale rule."""
    ck = _source(ctx.ckpt_root)
    if ck.layout == "mxfp4":
        return ck
    from ..checkpoint.quantized import Quantized

    return Quantized(ck, ctx.scale_rule or "round_up")


def _source(root: str) -> Checkpoint:
    """The build's source checkpoint, as it is stored."""
    if root not in _ck:
        if "://" in root:
            from ..checkpoint.ranged import RangedCheckpoint, connect

            _ck[root] = RangedCheckpoint.open_remote(connect(root), plain=True)
        else:
            _ck[root] = Checkpoint.open(root, plain=True)  # bf16 as u16 bits: no ml_dtypes in a build
    return _ck[root]


# A producer gives one tensor of a shard: per layer (``stacked``) or as row chunks; it reads only
# the source it needs and drops those pages from the process when done.
def _per_layer(fn):
    fn.stacked = True
    return fn


def _layer(layer: int, suffix: str) -> str:
    return names.layer_prefix(layer) + suffix


def _read_layer(ck: Checkpoint, layer: int, suffix: str, lo=None, hi=None, fn=lambda a: a):
    name = _layer(layer, suffix)
    out = fn(ck.read(name, lo, hi))
    ck.release(name, lo, hi)
    return out


def _shared(ctx: Context, ck: Checkpoint, index: int) -> dict:
    d = ctx.dims

    def row(suffix):
        return _per_layer(lambda layer: _read_layer(ck, layer, suffix, fn=lambda a: replicated.row(d, a)))

    return {
        "input_layernorm_weight": row("input_layernorm.weight"),
        "post_attn_layernorm_weight": row("post_attention_layernorm.weight"),
        "bias_out": _per_layer(lambda layer: _read_layer(ck, layer, "self_attn.o_proj.bias",
                                                          fn=lambda a: attention.o_bias(d, a))),
        "router_weights": _per_layer(lambda layer: _read_layer(
            ck, layer, "mlp.router.weight", fn=lambda a: replicated.router_weights(d, a))),
        "router_bias": _per_layer(lambda layer: _read_layer(ck, layer, "mlp.router.bias", fn=replicated.router_bias)),
        "gamma": lambda: iter([replicated.gamma(d, ck.read(names.FINAL_NORM))]),
        "inv_freq": lambda: iter([_inv_freq(d, ctx.rope)]),
    }


def _inv_freq(d: Dims, rope: dict) -> np.ndarray:
    """The fused-RoPE input [d/2, 1] fp32: the twin's (and transformers') YaRN frequencies."""
    from ..kernels.rope import inv_freq

    return np.ascontiguousarray(inv_freq(d.d, rope).numpy()[:, None])


def _embed(ctx: Context, ck: Checkpoint, index: int) -> dict:
    """The embedding file of one placement: row blocks of the source, each laid out in kernel lanes
    and cut to the file's share (``layout.embedding``), so a worker holds one block at a time."""
    d = ctx.dims
    lo, hi = 0, d.V
    if ctx.embedding == "vocab":
        rows = scalars.vocab_rows(d.V, d.tp)
        lo, hi = min(index * rows, d.V), min((index + 1) * rows, d.V)
    step = max(1, EMBED_CHUNK_BYTES // (d.Hp * 2))

    def table():
        for r0 in range(lo, hi, step):
            r1 = min(r0 + step, hi)
            block = embedding.table(d, ck.read(names.EMBED, r0, r1))
            ck.release(names.EMBED, r0, r1)
            yield embedding.hidden_shard(block, index, d.tp) if ctx.embedding == "hidden" else block
        if ctx.embedding == "vocab" and hi - lo < rows:  # the last rank's rows past V
            yield np.zeros((rows - (hi - lo), d.Hp), dtype("bf16").plain)

    return {"embed_tokens" if ctx.embedding == "host" else "embed_weight": table}


def _attn(ctx: Context, ck: Checkpoint, t: int) -> dict:
    """TP rank t's attention: it reads only its heads' rows of q/k/v (weights and biases apart, each
    once) and of the sinks. o_proj is read whole, one range a layer: the rank's columns are 1/tp of
    every row (strided), and S3 or the hub serve one range a GET, so reading only them would take
    a GET a row (2,880 of 1 KiB a layer for 120b) where one GET of tp times the bytes is cheaper."""
    d = ctx.dims
    (q0, q1), (k0, k1) = attention.heads(d, t)
    rows = {"q": (q0 * d.d, q1 * d.d), "k": (k0 * d.d, k1 * d.d), "v": (k0 * d.d, k1 * d.d)}

    def qkv(kind: str, fn):
        def one(layer):
            parts = [(_layer(layer, f"self_attn.{p}_proj.{kind}"), *rows[p]) for p in "qkv"]
            out = fn(*(ck.read(n, lo, hi) for n, lo, hi in parts))
            for n, lo, hi in parts:
                ck.release(n, lo, hi)
            return out
        return _per_layer(one)

    return {
        "W_qkv": qkv("weight", lambda q, k, v: attention.qkv_weight(d, q, k, v)),
        "bias_qkv": qkv("bias", attention.qkv_bias),
        "W_out": _per_layer(lambda layer: _read_layer(
            ck, layer, "self_attn.o_proj.weight", fn=lambda a: attention.w_out(d, t, a, ctx.v_scale))),
        "sink": _per_layer(lambda layer: _read_layer(ck, layer, "self_attn.sinks", q0, q1, attention.sink)),
    }


def _expert(ctx: Context, ck: Checkpoint, r: int) -> dict:
    d = ctx.dims
    lo, hi = r * d.E_L, (r + 1) * d.E_L

    def mx(suffix, fn):
        return _per_layer(lambda layer: _read_layer(ck, layer, "mlp.experts." + suffix, lo, hi, lambda a: fn(d, a)))

    if ctx.experts == "mxfp4":
        return {
            "expert_gate_up_weights": mx("gate_up_proj_blocks", experts_mx.gate_up_weights),
            "expert_gate_up_weights_scale": mx("gate_up_proj_scales", experts_mx.gate_up_scales),
            "expert_gate_up_bias": mx("gate_up_proj_bias", experts_mx.gate_up_bias),
            "expert_down_weights": mx("down_proj_blocks", experts_mx.down_weights),
            "expert_down_weights_scale": mx("down_proj_scales", experts_mx.down_scales),
            "expert_down_bias": mx("down_proj_bias", experts_mx.down_bias),
        }

    def dequantized(proj, fn):
        def one(layer):
            blocks = _read_layer(ck, layer, f"mlp.experts.{proj}_blocks", lo, hi)
            scales = _read_layer(ck, layer, f"mlp.experts.{proj}_scales", lo, hi)
            return fn(d, mxfp4.decode(blocks, scales))
        return _per_layer(one)

    return {
        "expert_gate_up_weights": dequantized("gate_up_proj", experts_bf16.gate_up_weights),
        "expert_gate_up_bias": mx("gate_up_proj_bias", experts_bf16.gate_up_bias),
        "expert_down_weights": dequantized("down_proj", experts_bf16.down_weights),
        "expert_down_bias": mx("down_proj_bias", experts_bf16.down_bias),
    }


def _tail(ctx: Context, ck: Checkpoint, v: int) -> dict:
    d = ctx.dims

    def shard():
        lo, hi = v * d.V_s, (v + 1) * d.V_s
        out = tail.lm_head_t(d, v, ck.read(names.LM_HEAD, lo, hi))
        ck.release(names.LM_HEAD, lo, hi)
        yield out

    return {"lm_head_weight_t": shard}


PRODUCERS = {"shared": _shared, "attn": _attn, "expert": _expert, "tail": _tail, "embed": _embed}


def run_shard(ctx: Context, job: ShardJob) -> tuple[str, int, str]:
    """Write one shard; return (path, size, sha256 of the bytes on disk)."""
    from pathlib import Path

    ck = _checkpoint(ctx)
    path = inside(Path(ctx.out_dir), job.path)
    meta = {"gkbuild_role": job.role, "gkbuild_layout_version": str(LAYOUT_VERSION)}
    producers = PRODUCERS[job.role](ctx, ck, job.index)
    # Tensors in file order, so the stream hashes as it appends (no read-back). Its bytes are on
    # the device when it closes (direct I/O); the parent syncs the filesystem (sizes, names)
    # before it records a shard as done, one sync for many files.
    with SafetensorsStream(path, list(job.tensors), meta, durable=False) as w:
        for name in w.order:
            produce = producers[name]
            chunks = (produce(layer) for layer in range(ctx.dims.L)) if getattr(produce, "stacked", False) \
                else produce()
            for data in chunks:
                w.append(name, data)
                _report(data.nbytes)
    return job.path, path.stat().st_size, w.sha256


def run_hash(root: str, name: str) -> tuple[str, str]:
    """(name, sha256) of a source file: in the folder ``root``, or read by range (a URI)."""
    from pathlib import Path

    advance = lambda n: _report(n, "hash")  # noqa: E731
    if "://" in root:
        return name, _source(root).remote.sha256(name, advance)
    return name, sha256_file(Path(root) / name, advance)
