"""float32 -> MXFP4 (the GPT-OSS checkpoint layout of :mod:`.mxfp4`), as a pure function.

``quantize(x, rule)`` blocks ``x`` [..., K] by 32 along its LAST axis and returns
``(blocks [..., K/32, 16] u8, scales [..., K/32] u8)``; :func:`dequantize` is :func:`mxfp4.decode`.
Two scale rules, each bit for bit the published implementation it names (the tests hold both to it):

``round_up`` -- triton_kernels' ``downcast_to_mxfp_torch`` with its default
    ``DequantScaleRoundingMode.ROUND_UP``: the function transformers' MXFP4 integration calls
    (transformers 5.24.0 ``integrations/mxfp4.py:203-205``, ``quantize_to_mxfp4``, which passes
    ``w.to(torch.bfloat16)``). Scale = 2^ceil(log2(amax / 6)) taken on the fp32 bits, so the block
    max never clips; elements are ``x * (1 / scale)`` rounded to e2m1 nearest, ties to even, and
    saturated at 6. Ported from triton-lang/triton@018a674f6d6d2b2ecedbb6225dc71721677b4cec
    ``python/triton_kernels/triton_kernels/numerics_details/mxfp.py`` (cited ``TK:line`` below).
    Special inputs, exactly as the reference:
      * all-zero block: scale byte 0, codes 0 (a -0.0 keeps its sign: code 8).
      * subnormal amax: amax/6 is subnormal and the bit trick rounds it UP to the smallest
        normal, scale byte 1 (2^-126); the elements become x * 2^126 < 1 and round to codes 0,
        0.5 or 1.0 (nearest even). Below that, an amax <= 3 * 2^-149 makes amax/6 round to 0:
        scale byte 0, multiplier 0, all codes (signed) zero.
      * +-inf in a block (no NaN): amax/6 = inf, whose bits + 0x7FFFFF stay at exponent 0xFF: scale
        byte 255 (NaN in E8M0, so the whole block decodes to NaN). 1/inf = 0, so finite elements
        become +-0 and each inf becomes inf*0 = NaN, which saturates to code 7 with that NaN's sign
        bit (the hardware's default NaN: negative on x86, whatever the inf's sign).
      * NaN in a block: amax is NaN and NaN bits + 0x7FFFFF carry out of the exponent into the sign
        bit, so the scale byte is 0 (not 255: the NaN is lost -- the kernel's own comment says
        "assume we don't care"). The multiplier is then 0: finite elements become +-0, a NaN element
        stays NaN and saturates to code 7 | its sign. The block decodes to zeros with +-6 * 2^-127
        where the NaNs were.
      * bf16: the reference casts its input to fp32 (exact for bf16); the rounding to bf16 is
        transformers' ``w.to(torch.bfloat16)`` before the call (nearest even; torch 2.13 CPU also
        turns every NaN into 0xFFFF, a negative NaN, hence code 15). ``quantize`` does no rounding:
        give it bf16-valued input (or an ml_dtypes bfloat16 array) to reproduce transformers' bytes.
    Versions: the transformers hub loads triton_kernels at run time, unpinned here. Older
    triton_kernels (e.g. @7146a7205c89742dbb17b6c18cdeeeb75c60f799) rounded elements half away
    from zero (``(... + 1) >> 1``, no sticky bit); 018a674f rounds to nearest even, as its GPU
    kernel ``mxfp_details/_downcast_to_mxfp.py`` (@0616e64515491718b6576b4cb3ba521f52a56d68) does,
    except that the kernel leaves the bits its subnormal shift drops out of the sticky bit (a
    tie reached only through those bits, e.g. q = 0.25 + 1 ulp, goes down there, up here).

``floor`` -- the OCP MX v1.0 rule as torchao 0.18.0 ``to_mx(x, torch.float4_e2m1fn_x2, 32,
    ScaleCalculationMode.FLOOR)`` computes it (``torchao/prototype/mx_formats/mx_tensor.py``, cited
    ``AO:line``; the element cast ``torchao/prototype/custom_fp_utils.py``, cited ``FP:line``).
    Scale = 2^(floor(log2 amax) - 2) from the exponent bits of amax, clamped to [-127, 128];
    elements are ``x / scale`` (scale clamped up to 2^-126) rounded to e2m1 nearest-even,
    saturating at 6 (so up to half the block max can clip, as the spec allows).
    torchao packs element 2j in the low nibble (``mx_formats/kernels.py:159-164``), as we do.
    Special inputs, exactly as torchao:
      * all-zero or subnormal amax: exponent field 0 -> -127 - 2, clamped to byte 0 (2^-127); the
        elements are divided by 2^-126 though (AO:359), so any block with amax < 2^-124 decodes to
        HALF what its codes were chosen for (torchao's own workaround, kept to stay bit-exact).
      * +-inf in a block (no NaN): exponent 0xFF -> 128 - 2 = 126, scale byte 253; inf / 2^126
        saturates to code 7 with the inf's sign; finite elements are divided by 2^126.
      * NaN in a block: scale byte 255 (AO:339-343), elements / inf: finite -> +-0; NaN stays NaN
        and, having no encoding, goes down torchao's normal-number branch: codes 2..4 from its
        payload (the default quiet NaN gives 3) | its sign; inf / inf is the hardware's default NaN.

Round trip (measured by tests/checkpoint/test_quantize.py over every scale 1..252 and all 256 code
bytes): for blocks from :func:`mxfp4.decode` with a scale byte s in 1..252 (larger s overflows
fp32 on decode, s = 0 puts values below fp32's normal range), ``quantize(decode(b, s),
"round_up")`` decodes to IDENTICAL values, signed zeros included. The bytes are identical exactly
when the block's largest |e2m1 value| M is 4 or 6, or s == 1. Otherwise the scale is re-derived
from M: 2^ceil(log2(M/6)) is 2^-1 for M in {2, 3}, 2^-2 for M in {1, 1.5}, 2^-3 for M = 0.5, so the
block comes back at s' = max(s - k, 1) with every code value multiplied by 2^(s - s') (still exact
in e2m1); an all-zero block comes back at scale 0. Not byte for byte because the format has
several (scale, codes) spellings of one block and the quantizer always picks the one its rule
derives from the block max. ``floor`` derives the same scale byte s - k (clamped at 0), and the
values come back identical exactly when s > k(M) or the block is zero; where s <= k its byte-0
quirk above halves them (also measured).
"""

from __future__ import annotations

import numpy as np

from . import mxfp4
from .mxfp4 import BLOCK

RULES = ("round_up", "floor")

# Blocks per chunk: 2^15 blocks = 1 Mi elements = 4 MiB per fp32/u32 temporary; the ~12 live
# temporaries of the element cast stay under ~64 MiB whatever the tensor's shape.
_CHUNK_BLOCKS = 1 << 15

_EXACT_IN_F32 = {np.dtype(np.float32), np.dtype(np.float16)}
try:  # numpy's view of bfloat16 (safetensors / ml_dtypes); its cast to fp32 is exact
    import ml_dtypes

    _EXACT_IN_F32.add(np.dtype(ml_dtypes.bfloat16))
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    pass

_U = np.uint32


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The inverse: :func:`mxfp4.decode` (scale 255 -> NaN)."""
    return mxfp4.decode(blocks, scales)


def quantize(x: np.ndarray, rule: str = "round_up") -> tuple[np.ndarray, np.ndarray]:
    """float [..., K] -> (blocks [..., K/32, 16] u8, scales [..., K/32] u8) under ``rule``."""
    if rule not in RULES:
        raise ValueError(f"unknown MXFP4 scale rule {rule!r}; choose one of {', '.join(RULES)}")
    x = np.asarray(x)
    if x.dtype not in _EXACT_IN_F32:
        raise ValueError(f"quantize takes float32, float16 or bfloat16 (exact in fp32), not {x.dtype}; "
                         "round to one of them first")
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"last axis of shape {x.shape} is not a multiple of {BLOCK}")
    k = x.shape[-1]
    # Blocks are independent: chunk over blocks, not rows, so one huge row is bounded too. (A
    # non-contiguous x is copied once here, in its own dtype.)
    flat = x.reshape(-1, BLOCK)
    n = flat.shape[0]
    blocks = np.empty((n, BLOCK // 2), np.uint8)  # packed per chunk: no full-size code array
    scales = np.empty(n, np.uint8)
    one = _round_up if rule == "round_up" else _floor
    with np.errstate(all="ignore"):  # inf*0, NaN compares, 1/0 under a where: all intended
        for i in range(0, n, _CHUNK_BLOCKS):
            j = min(i + _CHUNK_BLOCKS, n)
            codes, scales[i:j] = one(flat[i:j].astype(np.float32))
            blocks[i:j] = mxfp4.pack_codes(codes).reshape(j - i, BLOCK // 2)
    g = k // BLOCK
    return blocks.reshape(x.shape[:-1] + (g, BLOCK // 2)), scales.reshape(x.shape[:-1] + (g,))


def _round_up(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 32] fp32 -> ([n, 32] codes, [n] scale bytes): triton_kernels' ROUND_UP."""
    amax = np.abs(xb).max(axis=1)  # TK:259,265 (a NaN propagates, as torch's max does)
    ds = amax / np.float32(6.0)  # TK:191-193,270 (fp32 division, max e2m1 = 6.0)
    # TK:275-277: 2^ceil(log2 ds) on the bits: +0x7FFFFF bumps the exponent unless the mantissa
    # is 0 (u32 wraps where torch's int32 does; a NaN carries into the sign bit and comes out 0).
    ds_bits = (ds.view(_U) + _U(0x007FFFFF)) & _U(0x7F800000)
    ds_r = ds_bits.view(np.float32)  # TK:280
    qs = np.where(ds_r == 0, np.float32(0.0), np.float32(1.0) / ds_r)  # TK:290
    q = xb * qs[:, None]  # TK:295
    return _e2m1_rtne_tk(q), (ds_bits >> 23).astype(np.uint8)  # TK:345


def _e2m1_rtne_tk(q: np.ndarray) -> np.ndarray:
    """fp32 -> e2m1 codes (sign bit 3) on the bits, as TK:309-335 (RTNE, saturating at 7)."""
    bits = q.view(_U)  # TK:309
    sign = (bits >> 28) & _U(8)  # TK:311,335 (sign bit moved to bit 3)
    exp = (bits >> 23) & _U(0xFF)  # TK:312
    man = bits & _U(0x7FFFFF)  # TK:313
    sub = exp < 127  # TK:318: |q| < 1 is subnormal in e2m1 (bias 1)
    # TK:319: shift = 126 - exp. torch's int32 >> by >= 32 gives 0 for these positive values and
    # TK:322 clamps the mask's shift at 31; shifting 23+ already clears a 23-bit value, so clip.
    shift = (_U(126) - np.minimum(exp, _U(126))).clip(0, 31)
    pre = _U(0x400000) | (man >> 1)  # TK:320: the implicit 1 moved into the mantissa
    sticky = sub & (((man & _U(1)) != 0) | ((pre & ((_U(1) << shift) - _U(1))) != 0))  # TK:321-324
    man = np.where(sub, pre >> shift, man)  # TK:325
    e = np.maximum(exp, _U(126)) - _U(126)  # TK:326: rebias 127 -> 1, subnormals to 0
    m2 = (man >> 21) & _U(3)  # TK:328: kept mantissa bit + guard bit
    sticky |= (man & _U((1 << 21) - 1)) != 0  # TK:331
    inc = (m2 & _U(1)) & (sticky.astype(_U) | (m2 >> 1))  # TK:329-330,332
    code = np.minimum((((e << 2) | m2) + inc) >> 1, _U(7))  # TK:333-334
    return (sign | code).astype(np.uint8)  # TK:335


def _floor(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 32] fp32 -> ([n, 32] codes, [n] scale bytes): torchao to_mx FLOOR for fp4."""
    amax = np.abs(xb).max(axis=1)  # AO:247 (torch.amax: NaN propagates)
    pow2 = ((amax.view(_U) >> 23) & _U(0xFF)).astype(np.int32) - 127  # AO:309-314
    unbiased = np.clip(pow2 - 2, -127, 128)  # AO:317 (F4_E2M1_MAX_POW2 = 2), AO:329-331
    biased = (unbiased + 127).astype(np.uint8)  # AO:334-335
    biased = np.where(np.isnan(amax), np.uint8(255), biased)  # AO:339-343
    scale_f = (biased.astype(_U) << 23).view(np.float32)  # AO:348-350 (byte 255 -> +inf)
    scale_f = np.maximum(scale_f, np.float32(2.0 ** -126))  # AO:359 (F32_MIN_NORMAL)
    return _e2m1_rtne_ao(xb / scale_f[:, None]), biased  # AO:362, AO:394-396


def _e2m1_rtne_ao(d: np.ndarray) -> np.ndarray:
    """fp32 -> e2m1 codes as torchao's _f32_to_floatx_unpacked(x, 2, 1) (FP:27-141)."""
    bits = d.view(_U)
    sign = bits & _U(0x80000000)  # FP:81-82
    a_bits = bits ^ sign  # FP:85
    a = a_bits.view(np.float32)  # FP:89
    sat = a >= np.float32(6.0)  # FP:93 (max_normal 6.0)
    den = ~sat & (a < np.float32(1.0))  # FP:94 (min_normal 2^(1-1))
    # FP:63-71,105-108: adding 2^22 (exponent 149) rounds |x| < 1 to a multiple of 0.5, nearest
    # even, and its low mantissa bits are then the code (0, 1 or 2 = 1.0).
    den_code = ((a + np.float32(2.0 ** 22)).view(_U) - _U(149 << 23)).astype(np.uint8)
    # FP:113-123: rebias 127 -> 1 and round the mantissa to 1 bit, ties to even, on the bits; the
    # int32 -> uint8 cast keeps the low byte (that is what a NaN's payload turns into: codes 2-4).
    odd = (a_bits >> 22) & _U(1)
    norm = a_bits + _U(((1 - 127) << 23) % (1 << 32)) + _U((1 << 21) - 1) + odd
    norm_code = (norm >> 22).astype(np.uint8)
    code = np.where(den, den_code, np.where(sat, np.uint8(7), norm_code))  # FP:128-130
    return code | (sign >> 28).astype(np.uint8)  # FP:133-139 (sign to bit 3)
