"""Stand-in of the fork F's gate/up MX projection module as far as a build sees it: at import it
reads ``mega_flag_default_on("VLLM_NEURON_MEGA_SCALE_PACK64")``, and when that is on the kernel
expects the gate/up MX scales in HBM as [E_L, 2, 64, H/512, I/4] ("Requires the HBM scale in the
packed layout [E_L, 2, 64, H/512, I/4]; the test remaps it.").

Source: the stored index's file 70400980222, read with the search tool (its text imports
``kernel_helpers.mega_flag_default_on`` and ``projection_mx_constants``, both in F at 9f2490f6; the
index names no path for it, so it is not in gkbuild's committed interface of F). gkbuild writes the
scales as [E_L, 16, 2, H/512, I], so a build of F must turn this switch off explicitly.
"""

from ...utils.kernel_helpers import mega_flag_default_on

_SCALE_PACK64 = mega_flag_default_on("VLLM_NEURON_MEGA_SCALE_PACK64")


def check_weights(w) -> None:
    if not _SCALE_PACK64:
        return
    s, gu = w["expert_gate_up_weights_scale"], w["expert_gate_up_weights"]
    want = (s.shape[0], 2, 64, gu.shape[-2], gu.shape[-1] // 4)
    if tuple(s.shape) != want:
        raise AssertionError(f"SCALE_PACK64: gate/up scale must be [E_L, 2, 64, H/512, I/4] = {want}, got "
                             f"{tuple(s.shape)}")
