"""A dense (bf16/fp32) checkpoint for the tests whose experts lie exactly on the MXFP4 grid (what
``synth --dtype bf16`` does not make): an MXFP4 checkpoint's experts dequantized
(``quantized.mx_to_expert``) into transformers' layout, the other tensors carried over; one
tensor in memory at a time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from gkbuild.checkpoint import names
from gkbuild.checkpoint.quantized import as_float32, mx_to_expert, to_bf16_bits
from gkbuild.checkpoint.reader import Checkpoint, weight_files
from gkbuild.checkpoint.safetensors_io import SafetensorsWriter


def densify(src: Path, out: Path, dtype: str = "bf16") -> Path:
    """``src`` (MXFP4) as a dense checkpoint in ``out`` (one model.safetensors, src's config without
    its quantization_config, its tokenizer files)."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True)
    skip = set(weight_files(src)) | {"model.safetensors.index.json"}
    for p in src.iterdir():
        if p.is_file() and p.name not in skip | {"config.json"}:
            shutil.copy(p, out / p.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)  # a dense checkpoint has none (the reader holds it to that)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    ck = Checkpoint.open(src)
    try:
        specs = names.expected_specs(ck.config, dtype)
        with SafetensorsWriter(out / "model.safetensors", specs) as w:
            for s in specs:
                if names.dense_expert(s.name):
                    arr = mx_to_expert(ck.read(s.name + "_blocks"), ck.read(s.name + "_scales"))
                else:
                    arr = as_float32(ck.read(s.name))
                assert arr.shape == s.shape, (s.name, arr.shape, s.shape)
                w.write(s.name, to_bf16_bits(arr) if dtype == "bf16" else np.ascontiguousarray(arr, np.float32))
    finally:
        ck.close()
    return out
