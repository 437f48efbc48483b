"""``nki.language`` as far as the stand-ins and gkbuild's doctor probes use it.

- The dtypes are the documented names (awsdocs-neuron.readthedocs-hosted.com/en/v2.29.0/nki/api/generated/
  nki.language.float8_e4m3.html: ``nki.language.float8_e4m3 = 'float8_e4m3'``; the others alike).
- ``ndarray(shape, dtype, buffer=None)`` (nki.language.ndarray) declares a tensor: the fake records each
  FP8 type a trace declares, for the compiler's NCC_EOCP001 check (``torch_neuronx.trace``).
- ``load``, ``add``, ``store`` (nki.language.load/add/store): ``store`` into an argument is an
  in-place update.
- ``presented(t)`` is the fake's own seam, NOT an NKI API: the dtype an ``nki.jit`` kernel sees for a
  torch tensor argument. AWS does not document it for the MX types (gkbuild doctor item mx_carrier);
  ``GK_FAKE_MX_CARRIER`` (uint16 | float4_e2m1fn_x2, default uint16) names the torch dtype presented as
  ``float4_e2m1fn_x4``, ``GK_FAKE_MX_SCALE_CARRIER`` (uint8 | float8_e8m0fnu, default uint8) the one
  presented as ``float8_e8m0``. The other one of each pair arrives as itself.
"""

import os

import torch

bfloat16, float32, uint8, uint16, int32, uint32 = "bfloat16", "float32", "uint8", "uint16", "int32", "uint32"
float8_e4m3, float8_e4m3fn, float8_e5m2 = "float8_e4m3", "float8_e4m3fn", "float8_e5m2"
float8_e4m3fn_x4, float4_e2m1fn_x4, float8_e8m0 = "float8_e4m3fn_x4", "float4_e2m1fn_x4", "float8_e8m0"
sbuf, psum, hbm, shared_hbm = "sbuf", "psum", "hbm", "shared_hbm"

_declared: list[str] = []  # FP8 types declared since the trace began (torch_neuronx.trace resets it)
_FP8 = (float8_e4m3, float8_e4m3fn, float8_e4m3fn_x4, float4_e2m1fn_x4)


class _Declared(torch.Tensor):
    """A declared tensor: float32 values that remember their NKI dtype (``nki_dtype``)."""

    nki_dtype = None


def ndarray(shape, dtype, buffer=None, name=""):
    if dtype in _FP8:
        _declared.append(dtype)
    t = torch.zeros(tuple(shape), dtype=torch.float32).as_subclass(_Declared)
    t.nki_dtype = dtype
    return t


def load(src):
    """nki.language.load(src): an argument's values."""
    return src.tensor.clone()


def add(x, y):
    """nki.language.add(x, y)."""
    return x + y


def store(dst, value):
    """nki.language.store(dst, value): ``value`` written into ``dst`` (an array a kernel was given)."""
    dst.tensor.copy_(getattr(value, "tensor", value))


def presented(t) -> str:
    name = str(t.dtype).removeprefix("torch.")
    mx = os.environ.get("GK_FAKE_MX_CARRIER", "uint16")
    scale = os.environ.get("GK_FAKE_MX_SCALE_CARRIER", "uint8")
    if name == mx:
        return float4_e2m1fn_x4
    if name == scale:
        return float8_e8m0
    return name
