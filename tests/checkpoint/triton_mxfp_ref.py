"""triton_kernels' ``downcast_to_mxfp_torch`` transcribed into torch, for the MXFP4 + E8M0 path.

The independent reference the ``round_up`` rule of gkbuild.checkpoint.quantize is held to: torch
ops, the published function's steps in its order, not our numpy. Source:
triton-lang/triton@018a674f6d6d2b2ecedbb6225dc71721677b4cec
python/triton_kernels/triton_kernels/numerics_details/mxfp.py (``TK:line`` below). triton_kernels
itself cannot be installed here: the PyPI name ``triton-kernels`` (0.1.0) is an unrelated
Kernelize AI package without ``numerics_details``, and the real one imports ``triton`` (a CUDA
wheel) at module level, so the transcription stands in for it.

Left out: the fp8 outputs, E4M3 scales and ``expected_scale`` (TK:225-231, 242-247, 281-287,
301-305, 347-348), which the fp4/uint8 path with expected_scale=None never reaches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MXFP_BLOCK_SIZE = 32  # _downcast_to_mxfp.py: MXFP_BLOCK_SIZE = tl.constexpr(32)
ROUND_UP, ROUND_DOWN = 0, 1  # TK:18-23 DequantScaleRoundingMode


def _cdiv(a: int, b: int) -> int:  # triton.cdiv
    return (a + b - 1) // b


def right_shift_unsigned(x, shift):  # TK:186-188
    return (x >> shift) & ((1 << (32 - shift)) - 1)


def downcast_to_mxfp_torch(src_tensor: torch.Tensor, axis: int, rounding: int = ROUND_UP):
    """TK:196-349 with out_quant_type=torch.uint8, scale_dtype=torch.uint8, microblock_size=32."""
    ndim = src_tensor.ndim
    assert -ndim <= axis < ndim  # TK:214
    assert src_tensor.dtype in {torch.float32, torch.bfloat16, torch.float16}  # TK:215-216
    axis = axis if axis >= 0 else axis + ndim  # TK:218
    device = src_tensor.device  # TK:233
    axis_shape = src_tensor.size(axis)  # TK:236-238
    assert axis_shape % 2 == 0
    src = src_tensor.transpose(axis, src_tensor.ndim - 1).to(torch.float32)  # TK:241
    axis_shape = src.shape[-1]  # TK:248

    next_multiple = _cdiv(axis_shape, MXFP_BLOCK_SIZE) * MXFP_BLOCK_SIZE  # TK:251
    pad_amount = next_multiple - axis_shape  # TK:252
    padded_src = F.pad(src, (0, pad_amount))  # TK:253
    valid_mask = F.pad(torch.ones_like(src, dtype=torch.bool), (0, pad_amount))  # TK:254
    padded_axis_shape = padded_src.size(-1)  # TK:255

    abs_f = torch.abs(padded_src)  # TK:259
    abs_f = torch.where(valid_mask, abs_f, torch.tensor(-1.0, device=device, dtype=padded_src.dtype))  # TK:260
    new_shape = padded_src.shape[:-1] + (padded_axis_shape // MXFP_BLOCK_SIZE, MXFP_BLOCK_SIZE)  # TK:262
    abs_groups = abs_f.view(*new_shape)  # TK:263
    max_val, _ = abs_groups.max(dim=-1, keepdim=True)  # TK:265

    max_quant_val = 6.0  # TK:191-193, get_max_quant_val(torch.uint8)
    if rounding == ROUND_UP:  # TK:269-272
        dequant_scale = max_val / max_quant_val
    else:
        dequant_scale = max_val / (2 ** math.floor(math.log2(max_quant_val)))
    ds_int = dequant_scale.view(torch.int32)  # TK:275
    if rounding == ROUND_UP:  # TK:276-279
        ds_int_rounded = (ds_int + 0x007FFFFF) & 0x7F800000
    else:
        ds_int_rounded = ds_int & 0x7F800000
    dequant_scale_rounded = ds_int_rounded.view(torch.float32)  # TK:280

    quant_scale = torch.where(dequant_scale_rounded == 0, torch.tensor(0.0, device=device),
                              1.0 / dequant_scale_rounded)  # TK:290

    orig_padded_shape = padded_src.shape  # TK:293
    padded_src_groups = padded_src.view(*new_shape)  # TK:294
    quant_tensor = padded_src_groups * quant_scale  # TK:295
    quant_tensor = quant_tensor.view(orig_padded_shape)  # TK:297
    quant_tensor = quant_tensor[..., :axis_shape]  # TK:298

    q_int = quant_tensor.contiguous().view(torch.int32)  # TK:309
    signs = q_int & 0x80000000  # TK:311
    exponents = right_shift_unsigned(q_int, 23) & 0xFF  # TK:312
    mantissas_orig = q_int & 0x7FFFFF  # TK:313
    E8_BIAS = 127  # TK:315
    E2_BIAS = 1  # TK:316
    is_subnormal = exponents < E8_BIAS  # TK:318
    shift = E8_BIAS - exponents - 1  # TK:319
    mantissas_pre = (0x400000 | right_shift_unsigned(mantissas_orig, 1))  # TK:320
    bit0_dropped = (mantissas_orig & 0x1) != 0  # TK:321
    mask = (1 << shift.clamp(max=31)) - 1  # TK:322
    dropped_post = (mantissas_pre & mask) != 0  # TK:323
    sticky = is_subnormal & (bit0_dropped | dropped_post)  # TK:324
    mantissas = torch.where(is_subnormal, mantissas_pre >> shift, mantissas_orig)  # TK:325
    exponents = torch.maximum(exponents, torch.tensor(E8_BIAS - E2_BIAS, device=device)) - (E8_BIAS - E2_BIAS)  # TK:326
    m2bits = right_shift_unsigned(mantissas, 21) & 0x3  # TK:328
    lsb_keep = right_shift_unsigned(m2bits, 1) & 0x1  # TK:329
    guard = m2bits & 0x1  # TK:330
    sticky |= (mantissas & ((1 << 21) - 1)) != 0  # TK:331
    round_inc = guard & (sticky.to(torch.int32) | lsb_keep)  # TK:332
    e2m1_tmp = right_shift_unsigned(((exponents << 2) | m2bits) + round_inc, 1)  # TK:333
    e2m1_tmp = torch.minimum(e2m1_tmp, torch.tensor(0x7, device=device))  # TK:334
    e2m1_value = (right_shift_unsigned(signs, 28) | e2m1_tmp).to(torch.uint8)  # TK:335

    e2m1_value = e2m1_value.view(*e2m1_value.shape[:-1], axis_shape // 2, 2)  # TK:338
    evens = e2m1_value[..., 0]  # TK:339
    odds = e2m1_value[..., 1]  # TK:340
    out_weight = evens | (odds << 4)  # TK:341

    dq_scale = (ds_int_rounded.view(*dequant_scale.shape) >> 23).to(torch.uint8)  # TK:345
    dq_scale = dq_scale.squeeze(-1)  # TK:346
    out_weight = out_weight.transpose(axis, src_tensor.ndim - 1)  # TK:349
    dq_scale = dq_scale.transpose(axis, src_tensor.ndim - 1)  # TK:350
    return out_weight, dq_scale  # TK:351
