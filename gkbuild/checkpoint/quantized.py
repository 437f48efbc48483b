"""A dense (bf16 or fp32) GPT-OSS checkpoint seen as the MXFP4 one a build reads: its experts
quantized as they are read.

The build's producers, the reference and the golden read ``mlp.experts.*_blocks`` / ``_scales``.
Over a dense source (``names.LAYOUTS``) this view serves them from ``gate_up_proj`` [E, H, 2I] and
``down_proj`` [E, I, H]: a leading slice of experts is read, transposed to the blocks' [E, out, in]
and quantized by the recipe's scale rule (``quantize.quantize``), so only the experts asked for are
read, and a slice's blocks and scales come from one quantization (the part not yet read kept). Every other float tensor is served
in bf16 (an fp32 source rounded to nearest even, as ``torch.Tensor.to(torch.bfloat16)`` rounds).

With ``rule=None`` the experts stay dense (``gate_up_proj`` / ``down_proj``, float32 to the reader):
the bf16 original a quality gate measures the quantization against.
"""

from __future__ import annotations

import numpy as np

from .. import parallel
from ..errors import GkError
from . import names
from .mxfp4 import decode
from .quantize import quantize

MX_OF = {proj + part: proj for proj in names.PROJS for part in names.MX_PARTS}


def expert_to_mx(w: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Dense experts [n, in, out] (transformers' ``x @ w``) -> MXFP4 (blocks [n, out, in/32, 16],
    scales [n, out, in/32]), as the hub checkpoint stores them; an expert a thread (the float32
    temporaries of one 120b expert are 66 MB)."""
    n, k, m = w.shape
    blocks = np.empty((n, m, k // 32, 16), np.uint8)
    scales = np.empty((n, m, k // 32), np.uint8)

    def one(e: int) -> None:
        blocks[e], scales[e] = quantize(np.ascontiguousarray(as_float32(w[e]).T), rule)

    parallel.each(one, range(n))  # the experts on the host's cores (numpy's loops release the GIL)
    return blocks, scales


def mx_to_expert(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The inverse of ``expert_to_mx`` up to quantization: MXFP4 [n, out, in/32, 16] + [n, out, in/32]
    -> float32 [n, in, out], transformers' dequantized layout (integrations/mxfp4.py:285)."""
    return np.ascontiguousarray(decode(blocks, scales).transpose(0, 2, 1))


def as_float32(a: np.ndarray) -> np.ndarray:
    """A bf16 (ml_dtypes, or its u16 bits) or fp32 array as float32, exactly."""
    a = np.asarray(a)
    if a.dtype == np.uint16 or a.dtype.name == "bfloat16":
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (u16), rounded to nearest, ties to even (finite input: the reader has
    refused non-finite values before this runs)."""
    bits = np.asarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


class Quantized:
    """``ck`` (a dense-layout ``Checkpoint``) read as MXFP4 with ``rule``; the rest delegates to it."""

    layout = "mxfp4"

    def __init__(self, ck, rule: str | None):
        self.ck, self.rule = ck, rule
        self.source_layout = ck.layout
        # One quantization serves a slice's blocks and scales: the part not asked for is kept until it
        # is. A shard writes every layer's blocks before any layer's scales (its tensors in file order,
        # the u16 tiles first), so what waits is the scales, 1/16 of the blocks.
        self._other: dict[tuple, np.ndarray] = {}

    def __getattr__(self, attr):  # config, root, headers, where, extras, plain, close, deep_check, ...
        return getattr(self.ck, attr)

    def _bf16(self, arr: np.ndarray) -> np.ndarray:
        if self.ck.layout == "bf16":
            return arr
        bits = to_bf16_bits(arr)
        if self.ck.plain:
            return bits
        import ml_dtypes

        return bits.view(ml_dtypes.bfloat16)

    def read(self, name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        base, part = name[:-7], name[-7:]
        if not (names.EXPERTS in name and part in names.MX_PARTS and base.endswith(names.PROJS)):
            if names.dense_expert(name):
                if self.rule is not None:
                    raise GkError(f"{self.ck.root}: {name} is read quantized ({name}_blocks / _scales)")
                arr = as_float32(self.ck.read(name, lo, hi))
                self.ck.release(name, lo, hi)
                return arr
            return self._bf16(self.ck.read(name, lo, hi))
        if self.rule is None:
            raise GkError(f"{self.ck.root}: no tensor {name} (the dense original is read as {base})")
        kept = self._other.pop((base, lo, hi, part), None)
        if kept is not None:
            return kept
        blocks, scales = expert_to_mx(self.ck.read(base, lo, hi), self.rule)
        self.ck.release(base, lo, hi)
        other = "_scales" if part == "_blocks" else "_blocks"
        self._other[(base, lo, hi, other)] = scales if part == "_blocks" else blocks
        return blocks if part == "_blocks" else scales

    def _source_name(self, name: str) -> str:
        return name[:-7] if name.endswith(names.MX_PARTS) and names.EXPERTS in name else name

    def prefetch(self, name: str, lo: int, hi: int) -> None:
        self.ck.prefetch(self._source_name(name), lo, hi)

    def release(self, name: str, lo: int | None = None, hi: int | None = None) -> None:
        self.ck.release(self._source_name(name), lo, hi)


def mx_view(ck, rule: str | None = "round_up"):
    """What a reader of MXFP4 experts opens over any checkpoint: ``ck`` itself when it is MXFP4,
    else the ``Quantized`` view of it (``rule=None``: the dense original)."""
    return ck if ck.layout == "mxfp4" else Quantized(ck, rule)
