"""Synthesize a GPT-OSS checkpoint in the exact hub MXFP4 layout, streaming, deterministic per seed.

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
"""

from __future__ import annotations

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
        return (vals if n.endswith("sinks") else 1.0 + vals).astype(dtype("bf16").numpy)
    first = lo * size // 8
    bg.advance(first)
    skip = lo * size - first * 8
    raw = bg.random_raw((hi * size - first * 8 + 7) // 8).view(np.uint8)[skip:skip + (hi - lo) * size]
    if n.endswith("_blocks"):
        return raw
    if n.endswith("_scales"):
        return _mx_scales(raw, _fan_in(cfg, spec))
    if n.endswith("bias"):
        return _bf16(raw, 2.0 ** -5)
    if n == names.EMBED:
        return _bf16(raw, 1.0)
    return _bf16(raw, 1.0 / math.sqrt(_fan_in(cfg, spec)))


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


def weight_files(cfg: GptOssConfig, max_shard_bytes: int | None = None) -> dict[str, list[TensorSpec]]:
    """The weight files ``synthesize`` writes, in order: file name -> its tensors (files of at
    most ``DEFAULT_MAX_SHARD`` bytes unless told)."""
    groups = shard_specs(names.expected_specs(cfg), max_shard_bytes or DEFAULT_MAX_SHARD)
    return {f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors": g for k, g in enumerate(groups)}


def index_bytes(files: dict[str, list[TensorSpec]]) -> bytes:
    """The ``model.safetensors.index.json`` of those weight files."""
    total = sum(s.nbytes for g in files.values() for s in g)
    weight_map = {s.name: f for f, g in files.items() for s in g}
    return (json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n").encode()


def config_bytes(cfg: GptOssConfig, seed: int) -> bytes:
    """The ``config.json``: the model's HF config, and what synthesized it."""
    hf = cfg.to_hf()
    hf["gkbuild_synth"] = {"seed": seed, "version": SYNTH_VERSION}
    return (json.dumps(hf, indent=2, sort_keys=True) + "\n").encode()


def _chunks(spec: TensorSpec):
    """(first element, element count) of each chunk of a tensor."""
    total, step = math.prod(spec.shape), _step(spec)
    for start in range(0, total, step):
        yield start, min(step, total - start)


def synthesize(cfg: GptOssConfig, out: Path, seed: int = 0, max_shard_bytes: int = DEFAULT_MAX_SHARD,
               force: bool = False, advance: Advance = lambda n: None, jobs: int | None = None) -> Path:
    """Write the checkpoint into ``out`` atomically (built in a sibling temp folder, then renamed)."""
    out = Path(out)
    if out.exists():
        if not force and (not out.is_dir() or any(out.iterdir())):
            raise GkError(f"{out}: already exists and is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = weight_files(cfg, max_shard_bytes)
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
        (tmp / "config.json").write_bytes(config_bytes(cfg, seed))
        synth_tokenizer.write(cfg, tmp)
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
    return out


def total_bytes(cfg: GptOssConfig) -> int:
    return sum(s.nbytes for s in names.expected_specs(cfg))
