"""YaRN rotary embedding (GPT-OSS: theta 150000, factor 32, beta 32/1, original context 4096),
NeoX half-split rotation. cos and sin come pre-multiplied by the concentration 0.1*ln(factor)+1.

Two forms of the same numbers: the runtime computes cos/sin (``tables``) and passes them, or the
kernel takes ``inv_freq`` [d/2, 1] and the concentration and computes them from the positions
(``fused_tables``, decode.rope: fused).
"""

from __future__ import annotations

import math

import torch


def inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Per-frequency inverse wavelengths: interpolated below the YaRN ramp, extrapolated above."""
    base, factor = rope["theta"], rope["factor"]
    half = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    extrapolated = 1.0 / base ** half
    interpolated = extrapolated / factor
    orig = rope["original_max_position_embeddings"]

    def dim_for(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(rope["beta_fast"]), dim_for(rope["beta_slow"])
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return interpolated * (1 - extrapolate) + extrapolated * extrapolate


def tables(positions: torch.Tensor, head_dim: int, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim/2] for absolute positions (float32)."""
    return fused_tables(positions, inv_freq(head_dim, rope)[:, None], rope["concentration"])


def fused_tables(positions: torch.Tensor, inv_freq_column: torch.Tensor,
                 concentration: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., d/2] from the fused-RoPE inputs: inv_freq [d/2, 1] fp32 and the concentration."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq_column[:, 0]
    return freqs.cos() * concentration, freqs.sin() * concentration


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., heads, d] by cos/sin [..., d/2] (broadcast over heads): NeoX half split."""
    a, b = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
