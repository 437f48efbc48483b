"""Stand-in for baonudesifeizhai/nki-library@9f2490f6's ``gpt_oss_decode_mega_kernel``: its published
parameter list (from gkbuild's committed interface) and the body of ``_decode`` as F behaves: K/V
entry i, 0 or i // 2, the optional forms, the switches read default-on (``mega_flag_default_on``),
and its MoE module's scale layout (``gate_up_projection_mx``)."""

from _decode import make
from standin import kernel

from ...core.attention.attention_block_tkg import _k_update_fp8_packed
from ...core.moe.moe_tkg.gate_up_projection_mx import check_weights
from ...core.moe.moe_tkg.moe_block_tkg_utils import validate_moe_block_inputs
from . import _switches

REVISION = "baonudesifeizhai/nki-library@9f2490f68c3ff0c222458095e169b83778fe59e5"

gpt_oss_decode_mega_kernel = kernel(REVISION, "gpt_oss_decode_mega_kernel",
                                    make(paired=True, kv_update=_switches.kv_update,
                                         weights_check=check_weights, k_update=_k_update_fp8_packed,
                                         moe=validate_moe_block_inputs))
