"""``gkbuild quantize``: a dense (bf16/fp32) GPT-OSS checkpoint written out as the hub's MXFP4 one.

What is written is the ``quantized.Quantized`` view a build reads from the dense source, saved: the
same tensor names, shapes, dtypes and file split as ``gkbuild synth`` writes for MXFP4
(``names.expected_specs(cfg)``, ``synth.shard_files``), the experts quantized one expert at a time
(one quantization serves an expert's blocks and its scales), every other tensor in bf16 (an fp32
source rounded to nearest even). So a build of the output and a build of the dense source with the
same scale rule read the same bytes.

Streaming: tensors are read in leading-axis slices of at most ``SLICE_BYTES`` (an expert at a time)
and written positionally (``SafetensorsWriter``); the folder is built beside ``out`` and renamed
into place only when complete (``synth.atomic_folder``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import jsonio, parallel
from ..errors import GkError
from ..progress import Advance
from . import names
from .quantized import Quantized
from .reader import INDEX
from .safetensors_io import SafetensorsWriter, TensorSpec
from .synth import DEFAULT_MAX_SHARD, atomic_folder, index_bytes, shard_files

SLICE_BYTES = 64 << 20  # a non-expert tensor is copied in leading-axis slices of about this size
EXTRA_FILES = ("generation_config.json",)  # what save_pretrained writes beside the weights, kept


def output_specs(ck) -> list[TensorSpec]:
    return names.expected_specs(ck.config)


def total_bytes(ck) -> int:
    return sum(s.nbytes for s in output_specs(ck))


def config_bytes(ck, rule: str) -> bytes:
    """The source's config in the hub's form (``GptOssConfig.to_hf``, the source's other keys kept)
    with the hub's ``quantization_config`` (to_hf's: what synth writes); a ``dtype`` the source
    declared is now bf16, as every float tensor is; ``gkbuild_quantize`` says how it was made."""
    from ..recipe import QUANTIZER_VERSION

    hf = ck.config.to_hf()
    for key in ("dtype", "torch_dtype"):
        if key in hf:
            hf[key] = "bfloat16"
    hf["gkbuild_quantize"] = {"scale_rule": rule, "version": QUANTIZER_VERSION, "source_layout": ck.layout}
    return (json.dumps(hf, indent=2, sort_keys=True) + "\n").encode()


def refuse_mxfp4(ck) -> None:
    if ck.layout == "mxfp4":
        raise GkError(f"{ck.root}: already MXFP4 (its experts are *_blocks / *_scales); nothing to quantize")


def quantize_checkpoint(ck, out: Path, rule: str, tokenizer_dir: Path | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD, force: bool = False,
                        advance: Advance = lambda n: None) -> Path:
    """Write ``ck`` (an open dense ``Checkpoint`` or ``RangedCheckpoint``) as MXFP4 into ``out``.
    ``tokenizer_dir``: a folder whose tokenizer files (those it has) go beside the weights."""
    refuse_mxfp4(ck)
    view = Quantized(ck, rule)
    files = shard_files(output_specs(ck), max_shard_bytes)
    with atomic_folder(out, force) as tmp:
        for fname, group in files.items():
            with SafetensorsWriter(tmp / fname, group) as w:
                for spec in group:
                    if names.mx_expert(spec.name) and spec.name.endswith("_scales"):
                        continue  # written with its blocks, from the same quantization
                    _write(view, w, spec, advance)
        (tmp / INDEX).write_bytes(index_bytes(files))
        (tmp / "config.json").write_bytes(config_bytes(ck, rule))
        if tokenizer_dir is not None:
            from ..text import MAX_FILE, TOKENIZER_FILES

            for name in (*TOKENIZER_FILES, *EXTRA_FILES):
                p = Path(tokenizer_dir) / name
                if p.is_file():
                    (tmp / name).write_bytes(jsonio.read_bounded(p, MAX_FILE))
    return Path(out)


def _write(view: Quantized, w: SafetensorsWriter, spec: TensorSpec, advance: Advance) -> None:
    """One tensor (an expert's blocks: its scales too) into ``w``, a leading-axis slice at a time."""
    if names.mx_expert(spec.name):
        scales = spec.name[:-len("_blocks")] + "_scales"
        per_b, per_s = math.prod(spec.shape[1:]), math.prod(w.specs[scales].shape[1:])
        step = parallel.WORKERS  # experts quantized at once, a thread each (``expert_to_mx``)
        for e in range(0, spec.shape[0], step):
            hi = min(spec.shape[0], e + step)
            blocks = view.read(spec.name, e, hi)
            w.write(spec.name, blocks, e * per_b)
            w.write(scales, view.read(scales, e, hi), e * per_s)
            advance(blocks.nbytes + (hi - e) * per_s)
        return
    rows, per = spec.shape[0], math.prod(spec.shape[1:])
    step = max(1, SLICE_BYTES // max(spec.nbytes // max(rows, 1), 1))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        arr = view.read(spec.name, lo, hi)
        w.write(spec.name, arr, lo * per)
        view.release(spec.name, lo, hi)
        advance(arr.nbytes)
