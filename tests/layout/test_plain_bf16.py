"""A build reads bf16 as its u16 bits (no ml_dtypes import): every layout function that converts
bf16 values gives the bytes it gives for ml_dtypes bf16, and the bit conversions are ml_dtypes'."""

import warnings

import ml_dtypes
import numpy as np
import pytest

from gkbuild.dtypes import dtype
from gkbuild.layout import arrays, attention, experts_bf16, experts_mx, replicated
from gkbuild.layout.dims import Dims
from gkbuild.model import preset

BF = ml_dtypes.bfloat16


def _bytes(a):
    return np.ascontiguousarray(a).view(np.uint8)


def test_f32_and_f16_of_every_bf16_are_ml_dtypes():
    u = np.arange(1 << 16, dtype=np.uint16)
    assert np.array_equal(arrays.f32(u).view(np.uint32), u.view(BF).astype(np.float32).view(np.uint32))
    finite = np.isfinite(arrays.f32(u))  # a build refuses non-finite bf16 where it reads them
    with np.errstate(over="ignore"):  # beyond fp16's range: inf, in both
        assert np.array_equal(arrays.f32(u[finite]).astype(np.float16).view(np.uint16),
                              u[finite].view(BF).astype(np.float16).view(np.uint16))


def test_rounding_to_bf16_is_ml_dtypes():
    rng = np.random.default_rng(0)
    edges = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 1, 0x8000,
                      0x18000, 0x3F808000, 0x3F818000, 0x80008000], np.uint32)
    x = np.concatenate([rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32), edges]).view(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns casting NaN
        want = x.astype(BF).view(np.uint16)
    assert np.array_equal(arrays.like_bf16(x, np.zeros(1, np.uint16)), want)
    assert arrays.like_bf16(x[:4], np.zeros(1, BF)).dtype == BF


def test_plain_dtype_and_holds():
    bf16 = dtype("bf16")
    assert bf16.plain == np.uint16 and dtype("fp8_e4m3fn").plain == np.uint8 and dtype("fp32").plain == np.float32
    assert bf16.holds(np.dtype(np.uint16)) and bf16.holds(np.dtype(BF))
    assert not bf16.holds(np.dtype(np.float16)) and not dtype("u16").holds(np.dtype(BF))


@pytest.mark.parametrize("v_scale", [1.0, 0.37, 2.0 ** -3])
def test_layout_of_u16_bits_is_the_layout_of_bf16(v_scale):
    rng = np.random.default_rng(1)
    dims = Dims.of(preset("tiny-topology"), tp=2)
    H, E, L = dims.H, dims.E, dims.E_L

    def bf(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(BF)

    cases = {
        "router_weights": (lambda a: replicated.router_weights(dims, a), bf(E, H)),
        "router_bias": (replicated.router_bias, bf(E)),
        "gamma": (lambda a: replicated.gamma(dims, a), bf(H)),
        "row": (lambda a: replicated.row(dims, a), bf(H)),
        "o_bias": (lambda a: attention.o_bias(dims, a), bf(H)),
        "w_out": (lambda a: attention.w_out(dims, 1, a, v_scale), bf(H, dims.q * dims.d)),
        "mx gate_up_bias": (lambda a: experts_mx.gate_up_bias(dims, a), bf(L, 2 * dims.I)),
        "mx down_bias": (lambda a: experts_mx.down_bias(dims, a), bf(L, H)),
        "bf16 gate_up_bias": (lambda a: experts_bf16.gate_up_bias(dims, a), bf(L, 2 * dims.I)),
        "bf16 down_bias": (lambda a: experts_bf16.down_bias(dims, a), bf(L, H)),
    }
    for name, (fn, a) in cases.items():
        want, got = fn(a), fn(a.view(np.uint16))
        assert want.dtype == got.dtype or (want.dtype == BF and got.dtype == np.uint16), name
        assert np.array_equal(_bytes(got), _bytes(want)), name


def test_a_fold_that_overflows_u16_bits_is_refused():
    from gkbuild.errors import GkError

    dims = Dims.of(preset("tiny-topology"), tp=2)
    w = np.full((dims.H, dims.q * dims.d), 1e38, np.float32).astype(BF).view(np.uint16)
    with np.errstate(over="ignore"), pytest.raises(GkError, match="overflows bf16"):
        attention.w_out(dims, 0, w, 16.0)
