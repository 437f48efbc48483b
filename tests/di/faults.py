"""Faults of a DI transfer, each an edit of the transfer plan a decode side follows (``Prefill.edit``):
what a wrong plan, connector or runtime would read. Each names the layer it hits first."""

from dataclasses import dataclass
from typing import Callable


def _reads(plan: dict, layer: int):
    return [rd for r in plan["ranks"] for rd in r["reads"] if rd["layer"] == layer]


def off_by_one_block(plan: dict, layer: int = 1) -> dict:
    """The prefill block after the right one (a block offset one block_len too far)."""
    for rd in _reads(plan, layer):
        for s in rd["segments"]:
            s["prefill_offset"] += plan["prefill"]["block_len"]
    return plan


def wrong_head_slice(plan: dict, layer: int = 0) -> dict:
    """The other head of a prefill block holding two (decode TP8 reads one of prefill TP4's two)."""
    for rd in _reads(plan, layer):
        for s in rd["segments"]:
            s["prefill_offset"] = (s["prefill_offset"] + s["length"]) % plan["prefill"]["block_len"]
    return plan


def k_and_v_swapped(plan: dict, layer: int = 1) -> dict:
    """K read from the prefill's V region and V from its K region."""
    for r in plan["ranks"]:
        k, v = [rd for rd in r["reads"] if rd["layer"] == layer]
        k["prefill_region"], v["prefill_region"] = v["prefill_region"], k["prefill_region"]
    return plan


def no_n_minus_1(plan: dict) -> dict:
    """The sliding window taken for a first query at N (the decode admitting the prompt at N):
    at N % block == block - 1 the window's oldest block is never moved."""
    plan["swa"]["truncate"] = False
    return plan


def packed_k_unconverted(plan: dict) -> dict:
    """Packed FP8 K blocks left as the prefill wrote them ([block, d], token-major)."""
    plan["k_conversion"] = None
    return plan


@dataclass(frozen=True)
class Fault:
    name: str
    edit: Callable[[dict], dict]
    layer: int  # the first layer the fault shows in


CATALOGUE = [
    Fault("off by one block", off_by_one_block, 1),
    Fault("wrong head slice", wrong_head_slice, 0),
    Fault("K and V swapped", k_and_v_swapped, 1),
    Fault("missing N-1 truncation", no_n_minus_1, 0),  # sliding layers: 0
    Fault("packed K unconverted", packed_k_unconverted, 0),
]
