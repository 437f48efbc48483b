"""Generated from gkbuild/compile/interfaces/baonudesifeizhai+nki-library@9f2490f68c3ff0c222458095e169b83778fe59e5.json by
tests/compile/standins/standin.py: every switch the revision reads, read as its source reads it."""

import os

from nkilib.models.gpt_oss.c128_giga_kernel.core.utils.kernel_helpers import mega_flag_default_on


def read() -> dict:
    return {
        "VLLM_NEURON_MEGA_COLLECTIVE_PRIVATE_SRC": os.environ.get("VLLM_NEURON_MEGA_COLLECTIVE_PRIVATE_SRC", "1"),
        "VLLM_NEURON_MEGA_SBUF_INTERLAYER": mega_flag_default_on("VLLM_NEURON_MEGA_SBUF_INTERLAYER"),
        "VLLM_NEURON_MEGA_MOE_SBUF_COLLECTIVE": mega_flag_default_on("VLLM_NEURON_MEGA_MOE_SBUF_COLLECTIVE"),
        "VLLM_NEURON_MEGA_FP8_RS": mega_flag_default_on("VLLM_NEURON_MEGA_FP8_RS"),
        "VLLM_NEURON_MEGA_PREQUANT_MOE": mega_flag_default_on("VLLM_NEURON_MEGA_PREQUANT_MOE"),
        "VLLM_NEURON_MEGA_PREQUANT_AFF16": mega_flag_default_on("VLLM_NEURON_MEGA_PREQUANT_AFF16"),
        "VLLM_NEURON_MEGA_FP8_RS_SCALE": os.environ.get("VLLM_NEURON_MEGA_FP8_RS_SCALE", "1"),
        "VLLM_NEURON_MEGA_SBUF_ATTN_RS": mega_flag_default_on("VLLM_NEURON_MEGA_SBUF_ATTN_RS"),
        "VLLM_NEURON_MEGA_SBUF_ATTN_AG": bool(os.environ.get("VLLM_NEURON_MEGA_SBUF_ATTN_AG")),
        "VLLM_NEURON_MEGA_SBUF_RESID1": bool(os.environ.get("VLLM_NEURON_MEGA_SBUF_RESID1")),
        "VLLM_NEURON_MEGA_KV_UPDATE": mega_flag_default_on("VLLM_NEURON_MEGA_KV_UPDATE"),
        "VLLM_NEURON_MEGA_DISABLE_FA": mega_flag_default_on("VLLM_NEURON_MEGA_DISABLE_FA"),
        "VLLM_NEURON_MEGA_DOWN_PREFETCH": mega_flag_default_on("VLLM_NEURON_MEGA_DOWN_PREFETCH"),
        "VLLM_NEURON_MEGA_FUSE_RESID2": mega_flag_default_on("VLLM_NEURON_MEGA_FUSE_RESID2"),
        "VLLM_NEURON_MEGA_HOIST_MASK": mega_flag_default_on("VLLM_NEURON_MEGA_HOIST_MASK"),
    }


def kv_update() -> bool:
    return mega_flag_default_on("VLLM_NEURON_MEGA_KV_UPDATE")
