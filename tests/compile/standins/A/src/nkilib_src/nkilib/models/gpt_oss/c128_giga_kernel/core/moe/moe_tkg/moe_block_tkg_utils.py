"""aws-neuron/nki-library@e9ef98fc's MoE dtype test as a build sees it (the declared types the FP8 scan reads; body: standins/_moe.py)."""

import nki.language as nl
from _moe import parse, validate


def parse_moe_block_config(weights, scales):
    return parse(weights, scales, (nl.float4_e2m1fn_x4, nl.float8_e4m3fn_x4), nl.float8_e4m3fn_x4)


def validate_moe_block_inputs(weights, scales):
    validate(parse_moe_block_config(weights, scales))
