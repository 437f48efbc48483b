"""Stand-in for aws-neuron/nki-library@e9ef98fc's ``gpt_oss_decode_mega_kernel``: its published
parameter list (from gkbuild's committed interface) and the body of ``_decode`` as A behaves: K/V
entry i or 0, no paired form, the KV write-back read as ``bool(os.environ.get(...))``."""

from _decode import make
from standin import kernel

from ...core.attention.attention_block_tkg import _k_update_fp8_packed
from ...core.moe.moe_tkg.moe_block_tkg_utils import validate_moe_block_inputs
from . import _switches

REVISION = "aws-neuron/nki-library@e9ef98fc47b3323bf0de8ebcc984b8e2f3adff07"

gpt_oss_decode_mega_kernel = kernel(REVISION, "gpt_oss_decode_mega_kernel",
                                    make(paired=False, kv_update=_switches.kv_update, k_update=_k_update_fp8_packed,
                                         moe=validate_moe_block_inputs))
