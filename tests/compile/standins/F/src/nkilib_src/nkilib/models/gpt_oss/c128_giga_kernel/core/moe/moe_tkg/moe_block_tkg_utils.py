"""Stand-in of the MoE's ``parse_moe_block_config`` / ``validate_moe_block_inputs`` as far as a build
sees them: the MoE is MX when the experts' dtype, as the kernel sees it, is ``nl.float4_e2m1fn_x4`` or
``nl.float8_e4m3fn_x4``; at LNC=1 it takes MX only; it then quantizes its activations to
``nl.float8_e4m3fn_x4`` (QuantizeMX). How the SDK presents a torch dtype is the fake's
``nl.presented`` (undocumented: gkbuild doctor item mx_carrier)."""

import nki.language as nl
from _checks import kernel_assert


def parse_moe_block_config(weights, scales):
    w, s = nl.presented(weights), nl.presented(scales)
    is_mx = w in (nl.float4_e2m1fn_x4, nl.float8_e4m3fn_x4) and s == nl.float8_e8m0
    if is_mx:
        nl.ndarray((1,), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)  # the activations, QuantizeMX'd
    return is_mx, w, s


def validate_moe_block_inputs(weights, scales):
    is_mx, w, s = parse_moe_block_config(weights, scales)
    kernel_assert(is_mx, f"validate_moe_block_inputs: at LNC=1 the MoE takes MX experts only (float4_e2m1fn_x4 or "
                         f"float8_e4m3fn_x4 with float8_e8m0 scales), got {w} with {s} scales")
