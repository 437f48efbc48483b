"""The body of the MoE dtype test both stand-in trees' ``moe_block_tkg_utils`` call (A and F run the
same block): the MoE is MX when the experts' dtype, as the kernel sees it, is one of ``mx_types``;
at LNC=1 it takes MX only; it then quantizes its activations to ``quantized`` (QuantizeMX). How the
SDK presents a torch dtype is the fake's ``nl.presented`` (undocumented: gkbuild doctor item
mx_carrier). Source: aws-neuron/nki-library@e9ef98fc moe_block_tkg_utils.py,
``parse_moe_block_config`` (``dtype in (nl.float4_e2m1fn_x4, nl.float8_e4m3fn_x4)``) and
``validate_moe_block_inputs`` (MX only at LNC=1), as gkbuild/compile/rules.py cites them."""

import nki.language as nl

from _checks import kernel_assert


def parse(weights, scales, mx_types, quantized):
    w, s = nl.presented(weights), nl.presented(scales)
    is_mx = w in mx_types and s == nl.float8_e8m0
    if is_mx:
        nl.ndarray((1,), dtype=quantized, buffer=nl.sbuf)  # the activations, QuantizeMX'd
    return is_mx, w, s


def validate(parsed):
    is_mx, w, s = parsed
    kernel_assert(is_mx, f"validate_moe_block_inputs: at LNC=1 the MoE takes MX experts only (float4_e2m1fn_x4 or "
                         f"float8_e4m3fn_x4 with float8_e8m0 scales), got {w} with {s} scales")
