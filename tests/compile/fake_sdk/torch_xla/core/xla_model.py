import os


def xla_device():
    """The fake's device is the CPU; it records the compile mode it was started in."""
    with open(os.environ["GK_FAKE_SDK_LOG"], "a") as f:
        f.write(f"device target={os.environ.get('NEURON_PLATFORM_TARGET_OVERRIDE')} "
                f"pjrt={os.environ.get('PJRT_DEVICE')} kv_update={os.environ.get('VLLM_NEURON_MEGA_KV_UPDATE')}\n")
    return "cpu"
