"""The scalars and sizes a plan derives for the kernels, without numpy: planning (and so a no-op
build) imports none of the array code."""

from __future__ import annotations

import struct

UP_BIAS_SHIFT = 1.0  # folded into the up bias of the experts (``experts_mx``)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even, as numpy's cast)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def softmax_scale(d: int, k_scale: float = 1.0) -> float:
    """1/sqrt(d) with the FP8 K dequant scale folded in (the kernel reads raw FP8 K), as float32
    arithmetic gives it: the float64 product of two float32 values is exact, so rounding it once is
    the float32 product."""
    return _f32(_f32(d ** -0.5) * _f32(k_scale))


def clamps(limit: float) -> dict[str, float]:
    """The kernel's clamp scalars once +1 is folded into the up bias."""
    return {"gate_clamp_upper_limit": limit, "up_clamp_upper_limit": limit + UP_BIAS_SHIFT,
            "up_clamp_lower_limit": -limit + UP_BIAS_SHIFT}


def vocab_rows(V: int, tp: int) -> int:
    """Rows of the vocab-sharded embedding table a TP rank holds."""
    return -(-V // tp)
