"""Generated from gkbuild/compile/interfaces/aws-neuron+nki-library@e9ef98fc47b3323bf0de8ebcc984b8e2f3adff07.json by
tests/compile/standins/standin.py: every switch the revision reads, read as its source reads it."""

import os


def read() -> dict:
    return {
        "VLLM_NEURON_MEGA_SBUF_INTERLAYER": bool(os.environ.get("VLLM_NEURON_MEGA_SBUF_INTERLAYER")),
        "VLLM_NEURON_MEGA_MOE_SBUF_COLLECTIVE": bool(os.environ.get("VLLM_NEURON_MEGA_MOE_SBUF_COLLECTIVE")),
        "VLLM_NEURON_MEGA_FP8_RS": bool(os.environ.get("VLLM_NEURON_MEGA_FP8_RS")),
        "VLLM_NEURON_MEGA_PREQUANT_MOE": bool(os.environ.get("VLLM_NEURON_MEGA_PREQUANT_MOE")),
        "VLLM_NEURON_MEGA_PREQUANT_AFF16": bool(os.environ.get("VLLM_NEURON_MEGA_PREQUANT_AFF16")),
        "VLLM_NEURON_MEGA_FP8_RS_SCALE": os.environ.get("VLLM_NEURON_MEGA_FP8_RS_SCALE", "1"),
        "VLLM_NEURON_MEGA_SBUF_ATTN_RS": bool(os.environ.get("VLLM_NEURON_MEGA_SBUF_ATTN_RS")),
        "VLLM_NEURON_MEGA_KV_UPDATE": bool(os.environ.get("VLLM_NEURON_MEGA_KV_UPDATE")),
        "VLLM_NEURON_MEGA_DOWN_PREFETCH": bool(os.environ.get("VLLM_NEURON_MEGA_DOWN_PREFETCH")),
        "VLLM_NEURON_MEGA_FUSE_RESID2": bool(os.environ.get("VLLM_NEURON_MEGA_FUSE_RESID2")),
        "VLLM_NEURON_MEGA_HOIST_MASK": bool(os.environ.get("VLLM_NEURON_MEGA_HOIST_MASK")),
    }


def kv_update() -> bool:
    return bool(os.environ.get("VLLM_NEURON_MEGA_KV_UPDATE"))
