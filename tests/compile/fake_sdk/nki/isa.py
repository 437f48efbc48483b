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
