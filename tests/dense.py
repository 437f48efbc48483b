"""A dense (bf16/fp32) fine-tune for the tests, made from an MXFP4 checkpoint: its experts
dequantized (``quantized.mx_to_expert``) into transformers' layout, moved off the MXFP4 grid by
``jitter`` (relative gaussian noise), the other tensors carried over; one tensor in memory at a time."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from gkbuild.checkpoint import names
from gkbuild.checkpoint.quantized import as_float32, mx_to_expert, to_bf16_bits
from gkbuild.checkpoint.reader import Checkpoint, weight_files
from gkbuild.checkpoint.safetensors_io import SafetensorsWriter


def densify(src: Path, out: Path, dtype: str = "bf16", jitter: float = 0.0, seed: int = 0) -> Path:
    """``src`` (MXFP4) as a dense checkpoint in ``out`` (one model.safetensors, src's config and
    tokenizer files); each dense expert element times (1 + ``jitter`` * N(0, 1))."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True)
    skip = set(weight_files(src)) | {"model.safetensors.index.json"}
    for p in src.iterdir():
        if p.is_file() and p.name not in skip:
            shutil.copy(p, out / p.name)
    rng = np.random.default_rng(seed)
    ck = Checkpoint.open(src)
    try:
        specs = names.expected_specs(ck.config, dtype)
        with SafetensorsWriter(out / "model.safetensors", specs) as w:
            for s in specs:
                if names.dense_expert(s.name):
                    arr = mx_to_expert(ck.read(s.name + "_blocks"), ck.read(s.name + "_scales"))
                    if jitter:
                        arr = arr * (1 + jitter * rng.standard_normal(arr.shape, dtype=np.float32))
                else:
                    arr = as_float32(ck.read(s.name))
                assert arr.shape == s.shape, (s.name, arr.shape, s.shape)
                w.write(s.name, to_bf16_bits(arr) if dtype == "bf16" else np.ascontiguousarray(arr, np.float32))
    finally:
        ck.close()
    return out
