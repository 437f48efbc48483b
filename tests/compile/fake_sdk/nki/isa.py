"""``nki.isa.nc_matmul_mx`` as NKI documents it: "Available only on NeuronCore-v4 and newer"
(awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.nc_matmul_mx.html).
NeuronCore-v4 is Trn3; Trn2 is NeuronCore-v3. The target is the one a trace compiles for
(``NEURON_PLATFORM_TARGET_OVERRIDE``); outside a trace nothing is checked."""

import os

NEURONCORE_V4 = ("trn3", "gen4")


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    if target and target not in NEURONCORE_V4:
        raise RuntimeError(f"nc_matmul_mx is available only on NeuronCore-v4 and newer; target {target} is not")


# How the device converts to IEEE-style e4m3 (max 240) past its range is not documented (gkbuild doctor
# item fp8_saturation): GK_FAKE_FP8_SATURATION=saturate (default) clips to +-240; inf gives +-inf past
# it; env saturates only where NEURON_RT_ENABLE_OCP_SATURATION=1.
def tensor_copy(dst, src, engine=None, name=None):
    """``nisa.tensor_copy(dst=..., src=...)`` (the keyword form the published kernels use): src's values
    converted to dst's declared dtype (``nl.ndarray``)."""
    import ml_dtypes
    import numpy as np
    import torch

    x = getattr(src, "tensor", src).detach().float().numpy()
    if getattr(dst, "nki_dtype", None) == "float8_e4m3":
        mode = os.environ.get("GK_FAKE_FP8_SATURATION", "saturate")
        sat = mode == "saturate" or (mode == "env" and os.environ.get("NEURON_RT_ENABLE_OCP_SATURATION") == "1")
        y = np.clip(x, -240, 240) if sat else np.where(np.abs(x) > 240, np.sign(x) * np.inf, x)
        x = y.astype(ml_dtypes.float8_e4m3).astype(np.float32)
    dst.copy_(torch.from_numpy(np.ascontiguousarray(x)))
