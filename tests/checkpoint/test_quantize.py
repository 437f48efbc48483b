"""gkbuild.checkpoint.quantize, bit for bit against the implementations its rules name.

``floor`` against torchao 0.18.0's own ``to_mx`` (called here, on CPU); ``round_up`` against the
torch transcription of triton_kernels' ``downcast_to_mxfp_torch`` in triton_mxfp_ref.py (the real
triton_kernels is not installable here: see that file). Both on the same input classes.
"""

from __future__ import annotations

import tracemalloc
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from gkbuild.checkpoint import mxfp4
from gkbuild.checkpoint import quantize as qz
from gkbuild.checkpoint.quantize import RULES, dequantize, quantize

from .triton_mxfp_ref import downcast_to_mxfp_torch

with warnings.catch_warnings():  # torchao's import warns about its CUDA extensions and enums
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

F32_MAX = np.finfo(np.float32).max
BF16_MAX = np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # 3.3895314e38
MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)  # e2m1 rounding boundaries


def _bits(u32) -> np.ndarray:
    return np.asarray(u32, np.uint32).view(np.float32)


def _boundaries() -> np.ndarray:
    """Blocks holding every e2m1 midpoint and its two fp32 neighbours, at scales 2^-126..2^125.

    Element 0 of each block is 6 * 2^k, which pins both rules' scale at 2^k (round_up:
    ceil(log2(6*2^k / 6)) = k; floor: floor(log2(6*2^k)) - 2 = k), so the others sit exactly on
    (or one ulp either side of) a rounding boundary of the element cast.
    """
    rows = []
    pts = np.concatenate([MIDS, np.nextafter(MIDS, np.float32(0)), np.nextafter(MIDS, np.float32(9)),
                          np.float32([0.5, 1, 1.5, 2, 3, 4, 6, 5.99, 6.01])])
    pts = np.resize(pts, 31)
    for k in range(-126, 126):
        blk = np.concatenate([[np.float32(6.0)], pts]) * np.float32(2.0 ** k)
        sign = np.where(np.arange(32) % 3 == 1, -1, 1).astype(np.float32)
        rows.append((blk * sign).astype(np.float32))
    return np.stack(rows)  # [252, 32]


def _classes() -> dict[str, np.ndarray]:
    """Every input class of the brief, each [rows, K] float32 (some blocks mix classes)."""
    rng = np.random.default_rng(20250)
    c = {}
    for mag in (1e-30, 1e-6, 1e-2, 1.0, 7.0, 1e4, 1e30):
        c[f"normal*{mag:g}"] = (rng.standard_normal((8, 128)) * mag).astype(np.float32)
    z = np.zeros((4, 64), np.float32)
    z[1] = -0.0
    z[2, ::2] = -0.0
    c["zeros"] = z
    o = (rng.standard_normal((8, 128)) * 1e-3).astype(np.float32)
    o.reshape(-1, 32)[np.arange(32), rng.integers(0, 32, 32)] = np.float32(1e3) * rng.choice([-1, 1], 32)
    c["outlier"] = o
    sub32 = _bits(rng.integers(1, 1 << 23, (8, 64), dtype=np.uint32) | (rng.integers(0, 2, (8, 64), dtype=np.uint32) << 31))
    c["subnormal_f32"] = sub32
    sub16 = _bits((rng.integers(1, 1 << 7, (8, 64), dtype=np.uint32) << 16) | (rng.integers(0, 2, (8, 64), dtype=np.uint32) << 31))
    c["subnormal_bf16"] = sub16
    tiny = np.concatenate([sub32[:4], (rng.standard_normal((4, 64)) * 2.0 ** -125).astype(np.float32)])
    tiny[:, 0] = np.float32(2.0 ** -126)  # blocks whose amax is the smallest normal, or near it
    tiny[:, 32] = _bits(1)  # the smallest subnormal as a block max candidate
    c["tiny_mixed"] = tiny
    c["boundaries"] = _boundaries()
    sp = np.ones((6, 64), np.float32)
    sp[0, 3], sp[0, 40] = np.inf, -np.inf
    sp[1, 5], sp[1, 33] = np.nan, -np.nan
    sp[2, 0], sp[2, 1] = np.inf, np.nan  # inf and NaN in one block
    sp[2, 32:] = -np.inf
    sp[3, :32] = np.nan
    sp[3, 32:] = _bits([0x7F800001, 0x7FBFFFFF, 0xFFC00000, 0x7FFFFFFF] * 8)  # NaN payloads/signs
    sp[4, 0], sp[4, 32] = BF16_MAX, -BF16_MAX
    sp[5, 0], sp[5, 33] = F32_MAX, -F32_MAX
    c["inf_nan_max"] = sp
    c["random_bits"] = _bits(rng.integers(0, 1 << 32, (16, 256), dtype=np.uint64).astype(np.uint32))
    mixed = (rng.standard_normal((8, 256)) * np.exp(rng.uniform(-40, 40, (8, 1)))).astype(np.float32)
    mixed.reshape(-1, 32)[::5, 7] = 0.0
    mixed.reshape(-1, 32)[1::7, 3] = np.inf
    mixed.reshape(-1, 32)[2::9, 9] = np.nan
    mixed.reshape(-1, 32)[3::4] = sub32.reshape(-1, 32)[: mixed.reshape(-1, 32)[3::4].shape[0]]
    c["mixed"] = mixed
    return c


CLASSES = _classes()


def _torchao_floor(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """torchao to_mx FLOOR, converted to our layout.

    torchao 0.18.0 returns (scale float8_e8m0fnu [..., K/32], data uint8 [..., K/2]) (mx_tensor.py:
    400-401, 411), data packed by pack_uint4 with element 2j in the LOW nibble (kernels.py:159-164):
    our nibble order, so only the shape changes. The e8m0 scale's byte is the biased exponent.
    """
    scale, data = to_mx(t.contiguous(), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    d = data.view(torch.uint8).numpy()
    return d.reshape(d.shape[:-1] + (d.shape[-1] // 16, 16)), scale.view(torch.uint8).numpy()


def _triton_round_up(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The transcribed reference: [..., K/2] u8 (element 2j low nibble, TK:338-341) -> ours."""
    w, s = downcast_to_mxfp_torch(t, axis=-1)
    w = w.numpy()
    return w.reshape(w.shape[:-1] + (w.shape[-1] // 16, 16)), s.numpy()


REFS = {"floor": _torchao_floor, "round_up": _triton_round_up}


def _assert_bytes(ours, ref, what):
    (b, s), (rb, rs) = ours, ref
    assert b.shape == rb.shape and s.shape == rs.shape, what
    bad_s = np.flatnonzero(s.reshape(-1) != rs.reshape(-1))
    bad_b = np.flatnonzero(b.reshape(-1) != rb.reshape(-1))
    assert bad_s.size == 0, f"{what}: {bad_s.size} scale bytes differ, first block {bad_s[:3]}"
    assert bad_b.size == 0, f"{what}: {bad_b.size} block bytes differ, first at {bad_b[:3]}"


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_bit_exact_vs_reference_fp32(rule, name):
    x = CLASSES[name]
    _assert_bytes(quantize(x, rule), REFS[rule](torch.from_numpy(x.copy())), f"{rule}/{name}")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_bit_exact_vs_reference_bf16(rule, name):
    """bf16 in: the references take a torch bf16 tensor; ours an ml_dtypes bf16 array and the same
    values as float32. All three must agree (bf16 -> fp32 is exact; nothing rounds twice)."""
    x16 = torch.from_numpy(CLASSES[name].copy()).to(torch.bfloat16)  # RTNE, as transformers does
    as_f32 = x16.to(torch.float32).numpy()
    # the same bf16 bits (an astype from fp32 would re-round NaN payloads: ml_dtypes makes 0x7FC0,
    # torch 0xFFFF)
    as_ml = x16.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    ref = REFS[rule](x16)
    _assert_bytes(quantize(as_ml, rule), ref, f"{rule}/{name}/bf16")
    _assert_bytes(quantize(as_f32, rule), ref, f"{rule}/{name}/bf16-valued f32")


def _one_block(vals, rule):
    x = np.zeros(32, np.float32)
    x[: len(vals)] = vals
    b, s = quantize(x, rule)
    return mxfp4.unpack_codes(b)[: len(vals)].tolist(), int(s[0])


def test_special_inputs_documented():
    """The behaviour the module docstring states, spelled out (the references agree above)."""
    with np.errstate(invalid="ignore"):
        dnan = np.float32(np.inf) * np.float32(0)  # this machine's default NaN
    dsign = 8 if np.signbit(dnan) else 0
    # zeros: scale byte 0, signed zeros kept
    assert _one_block([0.0, -0.0], "round_up") == ([0, 8], 0)
    assert _one_block([0.0, -0.0], "floor") == ([0, 8], 0)
    # subnormal amax: round_up lifts the scale to 2^-126 (byte 1) and 2^-127 * 2^126 = 0.5;
    # floor clamps to byte 0 (2^-127) but divides by 2^-126: the same code 1, half the value
    assert _one_block([_bits(1 << 22), _bits(1 << 21), _bits(3 << 20)], "round_up") == ([1, 0, 1], 1)
    assert _one_block([_bits(1 << 22), _bits(1 << 21), _bits(3 << 20)], "floor") == ([1, 0, 1], 0)
    assert _one_block([_bits(4), _bits(1)], "round_up") == ([0, 0], 1)  # 4 * 2^-149 / 6 > 0
    assert _one_block([_bits(3), _bits(1)], "round_up") == ([0, 0], 0)  # 3 * 2^-149 / 6 -> 0
    # floor's byte 0 starts below amax 2^-124 (exponent field 2 -> 2 - 2): stored 2^-127, used 2^-126
    assert _one_block([np.float32(2.0 ** -124)], "floor") == ([6], 1)  # 4.0 at 2^-126: right
    assert _one_block([np.float32(2.0 ** -125)], "floor") == ([4], 0)  # 2.0 at 2^-127: half
    # inf: round_up scale 255 and inf*0 = default NaN -> 7 | its sign; floor 253, saturated
    assert _one_block([np.inf, -np.inf, 1.0], "round_up") == ([7 | dsign, 7 | dsign, 0], 255)
    assert _one_block([np.inf, -np.inf, 1.0], "floor") == ([7, 15, 0], 253)
    # NaN: round_up scale 0 (the carry), NaN codes 7 | sign; floor 255 and the default NaN -> 3
    assert _one_block([np.nan, -np.nan, 1.0], "round_up") == ([7, 15, 0], 0)
    assert _one_block([np.nan, -np.nan, 1.0], "floor") == ([3, 11, 0], 255)
    # max finite: neither overflows the scale
    assert _one_block([BF16_MAX], "round_up")[1] == 253 and _one_block([F32_MAX], "round_up")[1] == 253
    assert _one_block([BF16_MAX], "floor") == ([7], 252)  # 1.99 * 2^127 / 2^125 = 7.97 saturates


def test_rules_differ_where_they_should():
    """round_up never clips the block max; floor may (amax 7 -> scale 2^0, 7 saturates to 6)."""
    assert _one_block([7.0, 1.0], "round_up") == ([6, 1], 128)  # 7 / 2 = 3.5 -> 4 (code 6, even)
    assert _one_block([7.0, 1.0], "floor") == ([7, 2], 127)


def test_dequantize_is_decode_and_errors():
    b = np.random.default_rng(1).integers(0, 256, (3, 2, 16), dtype=np.uint8)
    s = np.array([[120, 130], [127, 1], [0, 200]], np.uint8)
    assert np.array_equal(dequantize(b, s).view(np.uint32), mxfp4.decode(b, s).view(np.uint32))
    with pytest.raises(ValueError, match="round_up, floor"):
        quantize(np.zeros(32, np.float32), "nearest")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.float32(1.0))
    with pytest.raises(ValueError, match="float64"):
        quantize(np.zeros(32))


# ---- round trip: quantize(dequantize(b, s), "round_up") --------------------------------------

_MAG = np.abs(mxfp4.E2M1)
_K = {6.0: 0, 4.0: 0, 3.0: 1, 2.0: 1, 1.5: 2, 1.0: 2, 0.5: 3}  # ceil(log2(M / 6)), measured below


def _round_trip_blocks():
    """Every (byte value, scale 1..252) pair as a block of that byte, and random blocks."""
    rng = np.random.default_rng(7)
    scales = np.arange(1, 253, dtype=np.uint8)
    b_all = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None, None], (256, scales.size, 16))
    s_all = np.broadcast_to(scales[None, :], (256, scales.size))
    # random blocks whose codes are capped at each magnitude, so every block max M occurs often
    cap = rng.integers(0, 8, (4096, 1))
    codes = np.minimum(rng.integers(0, 8, (4096, 32)), cap) | (rng.integers(0, 2, (4096, 32)) << 3)
    b_rnd = mxfp4.pack_codes(codes.astype(np.uint8)).reshape(4096, 16)
    s_rnd = rng.integers(1, 253, 4096).astype(np.uint8)
    b = np.concatenate([b_all.reshape(-1, 16), b_rnd])
    s = np.concatenate([s_all.reshape(-1), s_rnd])
    return b, s


def test_round_trip_values_identical_and_when_bytes_match():
    b, s = _round_trip_blocks()
    v = dequantize(b, s)  # [n*32]
    assert np.isfinite(v).all()
    b2, s2 = quantize(v, "round_up")
    # the values: identical, bit for bit (signed zeros too)
    assert np.array_equal(dequantize(b2, s2).view(np.uint32), v.view(np.uint32))
    # the bytes: the scale is re-derived from the block max M, s' = max(s - k(M), 1); zero -> 0
    m = _MAG[mxfp4.unpack_codes(b).reshape(-1, 32)].max(axis=1)
    k = np.vectorize(lambda mm: _K.get(float(mm), 0))(m)
    want = np.where(m == 0, 0, np.maximum(s.astype(int) - k, 1))
    assert np.array_equal(s2.astype(int), want)
    same = np.all(b2 == b, axis=1) & (s2 == s)
    predicted_same = (m > 0) & (np.isin(m, [4.0, 6.0]) | (s == 1))
    assert np.array_equal(same, predicted_same)
    assert same.sum() > 10_000 and (~same).sum() > 10_000  # both cases well represented


def test_round_trip_outside_the_normal_range():
    """Why the domain is 1..252: s = 0 loses values, s >= 253 decodes to inf at large codes."""
    b = np.full((1, 16), 0x71, np.uint8)  # 0.5, 6.0, ...
    v = dequantize(b, np.array([0], np.uint8))  # 0.5 * 2^-127 = 2^-128, 6 * 2^-127
    b2, s2 = quantize(v, "round_up")
    assert s2[0] == 1 and not np.array_equal(dequantize(b2, s2), v)  # 2^-128 * 2^126 -> 0
    with np.errstate(over="ignore"):
        assert np.isinf(dequantize(b, np.array([253], np.uint8))).any()


def test_floor_round_trip_values_except_byte_zero_quirk():
    b, s = _round_trip_blocks()
    v = dequantize(b, s)
    b2, s2 = quantize(v, "floor")
    m = _MAG[mxfp4.unpack_codes(b).reshape(-1, 32)].max(axis=1)
    k = np.vectorize(lambda mm: _K.get(float(mm), 0))(m)
    same_vals = np.all(dequantize(b2, s2).reshape(-1, 32).view(np.uint32)
                       == v.reshape(-1, 32).view(np.uint32), axis=1)
    assert np.array_equal(same_vals, (m == 0) | (s > k))  # byte 0 divides by 2^-126, stores 2^-127


# ---- chunking and memory --------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES)
def test_chunking_does_not_change_results(rule, monkeypatch):
    x = CLASSES["mixed"]
    x3 = np.concatenate([x, CLASSES["random_bits"][:, :256], CLASSES["boundaries"][:248].reshape(-1, 256)])
    x3 = x3[:52].reshape(4, -1, 256)
    whole = quantize(x3, rule)
    monkeypatch.setattr(qz, "_CHUNK_BLOCKS", 5)  # many chunks, splitting rows mid-way
    chunked = quantize(x3, rule)
    per_row = [quantize(r, rule) for r in x3.reshape(-1, 256)]
    _assert_bytes(chunked, whole, "chunked")
    _assert_bytes(whole, (np.stack([p[0] for p in per_row]).reshape(whole[0].shape),
                          np.stack([p[1] for p in per_row]).reshape(whole[1].shape)), "per row")
    # a non-contiguous view quantizes as its copy
    t = np.ascontiguousarray(x3.transpose(1, 0, 2))
    _assert_bytes(quantize(x3.transpose(1, 0, 2), rule), quantize(t, rule), "strided")


@pytest.mark.parametrize("rule", RULES)
def test_temporaries_are_bounded_by_the_chunk(rule, monkeypatch):
    """A 16 MiB input with 128 KiB chunks: the peak is the outputs (6 MiB) plus a few chunks."""
    x = np.random.default_rng(3).standard_normal((64, 65536), dtype=np.float32)
    monkeypatch.setattr(qz, "_CHUNK_BLOCKS", 1024)  # 32 Ki elements = 128 KiB of fp32
    tracemalloc.start()
    try:
        quantize(x, rule)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    outputs = x.size // 2 + x.size // 32
    assert peak < outputs + (4 << 20), f"peak {peak / 2**20:.1f} MiB"
