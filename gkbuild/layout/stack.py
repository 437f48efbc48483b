"""Per-layer tensors stacked on a leading layer axis, built once on the host.

The kernel indexes ``W[i]``; a tensor whose leading axis is 1 is shared by every layer.
"""

from __future__ import annotations

import numpy as np


def stack(layers: list[np.ndarray]) -> np.ndarray:
    """[per-layer arrays of one shape] -> [L, ...]."""
    shapes = {a.shape for a in layers}
    if len(shapes) != 1:
        raise ValueError(f"cannot stack layers of different shapes {sorted(shapes)}")
    return np.stack(layers)


def unstack(stacked: np.ndarray, num_layers: int) -> list[np.ndarray]:
    """Inverse of :func:`stack`; a leading axis of 1 is the same tensor for every layer."""
    if stacked.shape[0] not in (1, num_layers):
        raise ValueError(f"leading axis {stacked.shape[0]} is neither 1 nor the {num_layers} layers")
    return [stacked[i if stacked.shape[0] == num_layers else 0] for i in range(num_layers)]
