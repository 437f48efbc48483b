import json
import os


def xla_device():
    """The fake's device is the CPU; it records the compile mode it was started in."""
    with open(os.environ["GK_FAKE_SDK_LOG"], "a") as f:
        f.write(json.dumps({"xla_device": True, "target": os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE"),
                            "pjrt": os.environ.get("PJRT_DEVICE")}) + "\n")
    return "cpu"
