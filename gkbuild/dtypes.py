"""One table of the dtypes gkbuild handles, under each library's name for them.

gkbuild's own names (``bf16``, ``u16``, ``fp8_e4m3``...) appear in plans and manifests; numpy
carries bf16 and fp8 through ml_dtypes (or as their bits: ``plain``); safetensors has its own codes.

The numpy dtype is looked up on first use: importing ml_dtypes registers its types with numpy
(~0.6 s here), and planning, the cached stages of a no-op compile and ``farm`` need only names
and sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import GkError


@dataclass(frozen=True)
class DType:
    name: str  # gkbuild's name
    itemsize: int
    _numpy: str  # ``module:attribute`` of the numpy scalar type
    safetensors: str | None  # None: safetensors has no code for it (never stored in a shard)
    torch: str  # attribute of the torch module

    @property
    def numpy(self):
        return _numpy_dtype(self._numpy)

    @property
    def plain(self):
        """numpy's own dtype for these bytes: the type itself where numpy has it, else (bf16, fp8)
        unsigned ints of its width. A build moves bf16 as its u16 bits and never imports ml_dtypes
        (0.6 s of start-up)."""
        return _numpy_dtype(self._numpy if self._numpy.startswith("numpy:") else f"numpy:uint{8 * self.itemsize}")

    def holds(self, dt) -> bool:
        """Whether numpy dtype ``dt`` is this type, as itself or as its :attr:`plain` bits."""
        return dt == self.plain or dt.name == self._numpy.split(":")[1]


@functools.cache
def _numpy_dtype(where: str):
    import importlib

    import numpy as np

    module, attr = where.split(":")
    return np.dtype(getattr(importlib.import_module(module), attr))


_ALL = [
    DType("bf16", 2, "ml_dtypes:bfloat16", "BF16", "bfloat16"),
    DType("fp16", 2, "numpy:float16", "F16", "float16"),
    DType("fp32", 4, "numpy:float32", "F32", "float32"),
    DType("u8", 1, "numpy:uint8", "U8", "uint8"),
    DType("u16", 2, "numpy:uint16", "U16", "uint16"),
    DType("u32", 4, "numpy:uint32", "U32", "uint32"),
    DType("i32", 4, "numpy:int32", "I32", "int32"),
    DType("i64", 8, "numpy:int64", "I64", "int64"),
    # trn2 KV cache: IEEE-style e4m3 (max 240); safetensors cannot store it, and no shard holds it.
    DType("fp8_e4m3", 1, "ml_dtypes:float8_e4m3", None, "uint8"),
    # trn3 (OCP) e4m3fn (max 448).
    DType("fp8_e4m3fn", 1, "ml_dtypes:float8_e4m3fn", "F8_E4M3", "float8_e4m3fn"),
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
