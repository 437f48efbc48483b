"""One table of the dtypes gkbuild handles, under each library's name for them.

gkbuild's own names (``bf16``, ``u16``, ``fp8_e4m3``...) appear in plans and manifests; numpy
carries bf16 and fp8 through ml_dtypes; safetensors has its own codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import GkError


@dataclass(frozen=True)
class DType:
    name: str  # gkbuild's name
    numpy: np.dtype
    safetensors: str | None  # None: safetensors has no code for it (never stored in a shard)
    torch: str  # attribute of the torch module

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


_ALL = [
    DType("bf16", np.dtype(ml_dtypes.bfloat16), "BF16", "bfloat16"),
    DType("fp16", np.dtype(np.float16), "F16", "float16"),
    DType("fp32", np.dtype(np.float32), "F32", "float32"),
    DType("u8", np.dtype(np.uint8), "U8", "uint8"),
    DType("u16", np.dtype(np.uint16), "U16", "uint16"),
    DType("u32", np.dtype(np.uint32), "U32", "uint32"),
    DType("i32", np.dtype(np.int32), "I32", "int32"),
    DType("i64", np.dtype(np.int64), "I64", "int64"),
    # trn2 KV cache: IEEE-style e4m3 (max 240); safetensors cannot store it, and no shard holds it.
    DType("fp8_e4m3", np.dtype(ml_dtypes.float8_e4m3), None, "uint8"),
    # trn3 (OCP) e4m3fn (max 448).
    DType("fp8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), "F8_E4M3", "float8_e4m3fn"),
]
BY_NAME = {d.name: d for d in _ALL}
BY_SAFETENSORS = {d.safetensors: d for d in _ALL if d.safetensors}


def dtype(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise GkError(f"unknown dtype {name!r}; known: {', '.join(BY_NAME)}") from None


def from_safetensors(code: str) -> DType:
    try:
        return BY_SAFETENSORS[code]
    except KeyError:
        raise GkError(f"unsupported safetensors dtype {code!r}") from None


def torch_dtype(name: str):
    import torch

    return getattr(torch, dtype(name).torch)
