"""Synthesize a GPT-OSS checkpoint in the exact hub MXFP4 layout (or a dense bf16/fp32 one, as
transformers saves a dequantized fine-tune), streaming, deterministic per seed.

Weights have realistic scale: every projection's elements have RMS ~ 1/sqrt(fan_in), so a forward
pass keeps O(1) activations and the logits mean something. bf16 values are built from random bits
(sign, a small exponent spread, full mantissa) rather than from normal draws: as cheap as the disk.
MXFP4 blocks are uniform random codes; each block's E8M0 scale is set so the block's RMS matches
1/sqrt(fan_in), with a +-1 jitter.

Tensors are generated in chunks of about 16 MB, each from its own seed (seed, tensor, chunk), and
written positionally, so memory stays flat whatever the model size. Any element range of a chunk
is generated alone (``pieces``: the generator advanced to its offset), which is how
``synth_ranged`` serves a synth:// checkpoint by byte range without writing it. A small byte-level BPE
tokenizer and a chat template (``synth_tokenizer``) go beside the weights, so text prompts work.

``dtype="bf16"`` / ``"fp32"`` writes transformers' dense layout (``names.expected_specs(cfg, dtype)``):
every tensor but the experts holds the SAME values as the MXFP4 synth of that seed (same names,
same chunk seeds; fp32 is the bf16 value widened), so the two differ only in the experts. The dense
experts ``gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H] are random bf16 at the scale of the MX
experts (full mantissa: values no MXFP4 grid holds), and some MX blocks (32 along the contraction
axis, the quantizer's unit) are special, chosen by a hash of the block: all zeros, one outlier at least 4x
the rest, every element a bf16 subnormal, or a few subnormals. fp32 experts add 16 random low
mantissa bits, so they are not bf16 in disguise.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..dtypes import dtype
from ..errors import GkError
from ..model import GptOssConfig
from ..progress import Advance
from . import names, synth_tokenizer
from .reader import INDEX
from .safetensors_io import SafetensorsWriter, TensorSpec, fsync_dir
from .source import SYNTH_VERSION

DTYPES = ("mxfp4", "bf16", "fp32")  # names.LAYOUTS: what ``synthesize(dtype=...)`` writes
CHUNK_BYTES = 16 << 20
DEFAULT_MAX_SHARD = 4 << 30
_E2M1_RMS = math.sqrt(np.mean(np.array([0, .5, 1, 1.5, 2, 3, 4, 6]) ** 2))


def _bf16(raw: np.ndarray, rms: float) -> np.ndarray:
    """bf16 values from random bits: random sign and mantissa, an exponent spread over 4 octaves."""
    bits = raw.view(np.uint16)
    k = round(math.log2(rms / 0.88))  # E[(1+m)^2] E[4^e] over the 4 octaves gives RMS ~ 0.88 * 2^k
    exp = ((bits >> 7) & np.uint16(0x3)) + np.uint16(127 + k - 3)
    return ((bits & np.uint16(0x807F)) | (exp << np.uint16(7))).view(dtype("bf16").numpy)


def _mx_scales(raw: np.ndarray, fan_in: int) -> np.ndarray:
    """E8M0 scales giving each block an RMS of 1/sqrt(fan_in), jittered by -1/0/+1."""
    center = 127 - round(math.log2(_E2M1_RMS * math.sqrt(fan_in)))
    return (raw & 1) + ((raw >> 1) & 1) + np.uint8(center - 1)


def _fan_in(cfg: GptOssConfig, spec: TensorSpec) -> int:
    """The input width of the projection a tensor belongs to (what its RMS is scaled by)."""
    n = spec.name
    if "down_proj" in n:
        return cfg.I
    if "o_proj" in n:
        return cfg.q_heads * cfg.d
    return cfg.H


def _itemsize(spec: TensorSpec) -> int:
    """Bytes of raw generator output an element is made from: a float tensor is generated as bf16
    whatever it is stored as (so an fp32 tensor has the bf16 one's chunks and values)."""
    return 1 if spec.name.endswith(("_blocks", "_scales")) else 2


def _step(spec: TensorSpec) -> int:
    """Elements a chunk of the tensor holds (the last one may hold fewer)."""
    return max(1, CHUNK_BYTES // _itemsize(spec))


def _piece(cfg: GptOssConfig, spec: TensorSpec, seed: int, chunk: int, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of chunk ``chunk`` of a tensor, generated alone.

    A chunk is seeded by (seed, tensor, chunk); its elements are a function of the generator's
    raw output at their own byte offsets, so the generator is advanced to ``lo`` (PCG64DXSM's
    ``advance``: as if that many 64-bit words were drawn) and draws only what [lo, hi) needs.
    Norms and sinks draw uniforms after the chunk's raw bytes (how the first synth drew them):
    those small tensors draw their chunk's uniforms up to ``hi``."""
    n = spec.name
    size = _itemsize(spec)
    total = math.prod(spec.shape)
    count = min(_step(spec), total - chunk * _step(spec))  # the chunk's elements
    bg = np.random.PCG64DXSM(np.random.SeedSequence([seed, zlib.crc32(n.encode()), chunk]))
    if n.endswith(("layernorm.weight", "sinks")) or n == names.FINAL_NORM:
        bg.advance((count * size + 7) // 8)
        low, high = (-2.0, 2.0) if n.endswith("sinks") else (-0.125, 0.125)
        vals = np.random.Generator(bg).uniform(low, high, hi)[lo:]
        return _stored(spec, (vals if n.endswith("sinks") else 1.0 + vals).astype(dtype("bf16").numpy))
    first = lo * size // 8
    bg.advance(first)
    skip = lo * size - first * 8
    raw = bg.random_raw((hi * size - first * 8 + 7) // 8).view(np.uint8)[skip:skip + (hi - lo) * size]
    if n.endswith("_blocks"):
        return raw
    if n.endswith("_scales"):
        return _mx_scales(raw, _fan_in(cfg, spec))
    if n.endswith("bias"):
        return _stored(spec, _bf16(raw, 2.0 ** -5))
    if n == names.EMBED:
        return _stored(spec, _bf16(raw, 1.0))
    if names.dense_expert(n):
        return _dense_expert(cfg, spec, seed, chunk * _step(spec) + lo, raw)
    return _stored(spec, _bf16(raw, 1.0 / math.sqrt(_fan_in(cfg, spec))))


def _stored(spec: TensorSpec, bf: np.ndarray) -> np.ndarray:
    """bf16 values as the tensor stores them (fp32: widened, exactly)."""
    if spec.dtype == "bf16":
        return bf
    return (bf.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _mix(x: np.ndarray, seed: int) -> np.ndarray:
    """A 64-bit hash of each u64 (splitmix64's finalizer, salted by the seed)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % (1 << 64))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


SPECIAL_EVERY = 16  # one MX block in about this many is special (``_dense_expert``)


def _dense_expert(cfg: GptOssConfig, spec: TensorSpec, seed: int, first: int, raw: np.ndarray) -> np.ndarray:
    """Dense expert elements from flat index ``first`` on, from their raw bytes: random bf16 at
    the MX experts' scale, and the special blocks (module docstring) by a hash of each element's
    MX block (expert, output column, 32-group of the contraction axis), so any range is made alone.
    Made 1 Mi elements at a time (the u64 index temporaries of a whole chunk would be ~0.5 GB)."""
    rms = 1.0 / math.sqrt(_fan_in(cfg, spec))
    vals = _bf16(raw, rms).view(np.uint16)
    top = np.uint16((127 + round(math.log2(rms / 0.88)) + 3) << 7)  # 4x above _bf16's highest octave
    out = np.empty(vals.size, np.uint16 if spec.dtype == "bf16" else np.uint32)
    step = 1 << 20
    for a in range(0, vals.size, step):
        out[a:a + step] = _special(spec, seed, first + a, vals[a:a + step], top)
    return out.view(dtype("bf16").numpy if spec.dtype == "bf16" else np.float32)


def _special(spec: TensorSpec, seed: int, first: int, vals: np.ndarray, top: np.uint16) -> np.ndarray:
    """``_dense_expert`` over one run of elements (bf16 bits in; bf16 bits, or fp32 bits, out);
    ``top``: the exponent bits of an outlier."""
    E, K, M = spec.shape  # [E, in, out]: the contraction axis first (``x @ w``)
    f = np.arange(first, first + vals.size, dtype=np.uint64)
    col = f % np.uint64(M)
    row = (f // np.uint64(M)) % np.uint64(K)
    block = (f // np.uint64(K * M) * np.uint64(K // 32) + row // np.uint64(32)) * np.uint64(M) + col
    h = _mix(block, seed)
    kind = (h % np.uint64(SPECIAL_EVERY)).astype(np.uint8)
    at = row % np.uint64(32)
    vals = np.where(kind == 1, np.uint16(0), vals)  # an all-zero block
    outlier = (kind == 2) & (at == (h >> np.uint64(8)) % np.uint64(32))  # one element at least 4x the block's others
    vals = np.where(outlier, (vals & np.uint16(0x807F)) | top, vals)
    tiny = (kind == 3) | ((kind == 4) & (at < 4))  # bf16 subnormals: the whole block, or 4 of its elements
    vals = np.where(tiny, (vals & np.uint16(0x807F)) | np.uint16(1), vals)
    if spec.dtype == "bf16":
        return vals
    low = (_mix(f, seed ^ 0x5EED) & np.uint64(0xFFFF)).astype(np.uint32)
    wide = vals.astype(np.uint32) << np.uint32(16)
    return np.where(vals & np.uint16(0x7FFF), wide | low, wide)


def pieces(cfg: GptOssConfig, spec: TensorSpec, seed: int, start: int, count: int):
    """Elements [start, start + count) of a tensor (flat, C order), one array per chunk touched:
    any range costs only its own elements (what ``synthesize`` writes and ``synth_ranged`` reads)."""
    step = _step(spec)
    end = start + count
    while start < end:
        chunk, lo = divmod(start, step)
        hi = min(step, lo + end - start)
        yield _piece(cfg, spec, seed, chunk, lo, hi)
        start += hi - lo


def shard_specs(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into files of at most ``max_shard_bytes`` (a tensor is never split)."""
    files: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if files[-1] and size + s.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(s)
        size += s.nbytes
    return files


def weight_files(cfg: GptOssConfig, max_shard_bytes: int | None = None,
                 dtype: str = "mxfp4") -> dict[str, list[TensorSpec]]:
    """The weight files ``synthesize`` writes, in order: file name -> its tensors (files of at
    most ``DEFAULT_MAX_SHARD`` bytes unless told)."""
    return shard_files(names.expected_specs(cfg, check_dtype(dtype)), max_shard_bytes)


def shard_files(specs: list[TensorSpec], max_shard_bytes: int | None = None) -> dict[str, list[TensorSpec]]:
    """Tensors, in order, as the hub names its weight files: file name -> its tensors."""
    groups = shard_specs(specs, max_shard_bytes or DEFAULT_MAX_SHARD)
    return {f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors": g for k, g in enumerate(groups)}


def index_bytes(files: dict[str, list[TensorSpec]]) -> bytes:
    """The ``model.safetensors.index.json`` of those weight files."""
    total = sum(s.nbytes for g in files.values() for s in g)
    weight_map = {s.name: f for f, g in files.items() for s in g}
    return (json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n").encode()


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise GkError(f"synth dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def config_bytes(cfg: GptOssConfig, seed: int, dtype: str = "mxfp4") -> bytes:
    """The ``config.json``: the model's HF config, and what synthesized it.

    Dense: as transformers saves a model loaded with ``Mxfp4Config(dequantize=True)``: no
    ``quantization_config`` (transformers==5.24.0: quantizers/base.py:220-221 and :227-235 delete
    it once a pre-quantized model is dequantized) and ``dtype`` naming the weights' torch dtype
    (modeling_utils.py:3443, ``save_pretrained``)."""
    hf = cfg.to_hf()
    hf["gkbuild_synth"] = {"seed": seed, "version": SYNTH_VERSION}
    if check_dtype(dtype) != "mxfp4":
        del hf["quantization_config"]
        hf["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
        hf["gkbuild_synth"]["dtype"] = dtype
    return (json.dumps(hf, indent=2, sort_keys=True) + "\n").encode()


def _chunks(spec: TensorSpec):
    """(first element, element count) of each chunk of a tensor."""
    total, step = math.prod(spec.shape), _step(spec)
    for start in range(0, total, step):
        yield start, min(step, total - start)


def synthesize(cfg: GptOssConfig, out: Path, seed: int = 0, max_shard_bytes: int = DEFAULT_MAX_SHARD,
               force: bool = False, advance: Advance = lambda n: None, jobs: int | None = None,
               dtype: str = "mxfp4") -> Path:
    """Write the checkpoint into ``out`` atomically (built in a sibling temp folder, then renamed);
    ``dtype``: ``mxfp4`` (the hub's layout) or a dense ``bf16`` / ``fp32`` one (module docstring)."""
    check_dtype(dtype)
    with atomic_folder(out, force) as tmp:
        files = weight_files(cfg, max_shard_bytes, dtype)
        for fname, group in files.items():
            # Chunks are independent (own seed, own offset): generate and write them on a thread
            # pool; the generator and the writes release the GIL.
            with SafetensorsWriter(tmp / fname, group) as w, \
                    ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
                def job(spec, start, count, w=w):
                    for data in pieces(cfg, spec, seed, start, count):
                        w.write(spec.name, data, start)
                        start += data.size
                        advance(data.nbytes)

                futures = [pool.submit(job, spec, *c) for spec in group for c in _chunks(spec)]
                for f in futures:
                    f.result()
        (tmp / INDEX).write_bytes(index_bytes(files))
        (tmp / "config.json").write_bytes(config_bytes(cfg, seed, dtype))
        synth_tokenizer.write(cfg, tmp)
    return Path(out)


def refuse_existing(out: Path, force: bool) -> None:
    """An existing ``out`` other than an empty folder is refused unless ``force``."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise GkError(f"{out}: already exists and is not empty (use --force to replace it)")


@contextlib.contextmanager
def atomic_folder(out: Path, force: bool = False):
    """A temp folder beside ``out`` to write a checkpoint into; renamed to ``out`` (its files
    fsynced) only when the block ends without an error, else removed: nothing half-written. An
    existing non-empty ``out`` is refused unless ``force`` (then replaced)."""
    out = Path(out)
    refuse_existing(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def total_bytes(cfg: GptOssConfig, dtype: str = "mxfp4") -> int:
    return sum(s.nbytes for s in names.expected_specs(cfg, dtype))
