"""``torch_neuronx.trace`` as the torch-neuronx tracing API documents it (SDK 2.28+:
frameworks/torch/torch-neuronx/api-reference-guide/inference/api-torch-neuronx-trace on
awsdocs-neuron.readthedocs-hosted.com):

    trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None,
          compiler_args=None, partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False)

Everything after ``example_inputs`` is keyword-only. What this fake holds the caller to, each from
AWS's documents:
- compiling without hardware needs ``NEURON_PLATFORM_TARGET_OVERRIDE`` (vllm-neuron CPU compilation:
  "required to specify the target platform for compilation, since no hardware is present");
- without ``cpu_backend`` it needs a NeuronCore (this machine has none; ``GK_FAKE_NEURON_DEVICE=1``
  stands for one);
- neuronx-cc refuses an F8E4M3FN operand on trn1/trn2 unless ``--experimental-unsafe-fp8e4m3fn-as-fp8e4m3``
  is given (compiler error NCC_EVRF051).
It runs ``func`` on the example inputs (the kernel stand-ins make the kernels' own assertions),
writes the compiler's NEFF (the documented header, ``tests/compile/neff_files``) into
``compiler_workdir`` and, for the tests, what the program returned (``outputs.json``).
"""

import json
import os

import torch

FP8_FLAG = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


def _target(args):
    for a in args:
        if a.startswith("--target="):
            return a.split("=", 1)[1]
    return None


def trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None, compiler_args=None,  # noqa: B006
          partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False):
    if _:
        raise TypeError("trace() takes 2 positional arguments")
    override = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    if cpu_backend and not override:
        raise RuntimeError("NEURON_PLATFORM_TARGET_OVERRIDE is required to compile without Neuron hardware")
    if not cpu_backend and not os.environ.get("GK_FAKE_NEURON_DEVICE"):
        raise RuntimeError("no Neuron device found (trace on a NeuronCore, or pass cpu_backend=True)")
    args = list(compiler_args or [])
    target = _target(args)
    if override and target and override != target:
        raise RuntimeError(f"--target={target} does not match NEURON_PLATFORM_TARGET_OVERRIDE={override}")
    switches = {k: v for k, v in os.environ.items() if k.startswith("VLLM_NEURON_MEGA_")}
    with open(os.environ["GK_FAKE_SDK_LOG"], "a") as f:
        f.write(json.dumps({"cpu_backend": cpu_backend, "target": override, "pjrt": os.environ.get("PJRT_DEVICE"),
                            "args": args, "switches": switches}) + "\n")
    outs = func(*example_inputs)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    tensors = list(example_inputs) + list(outs)
    if target in ("trn1", "trn2") and any(t.dtype == torch.float8_e4m3fn for t in tensors) and FP8_FLAG not in args:
        raise RuntimeError("NCC_EVRF051: Data type F8E4M3FN is not supported on TRN1/TRN2.")
    from tests.compile.neff_files import make

    os.makedirs(compiler_workdir, exist_ok=True)
    with open(os.path.join(compiler_workdir, "graph.neff"), "wb") as f:
        f.write(make(name="graph", lnc=1))
    with open(os.path.join(compiler_workdir, "outputs.json"), "w") as f:
        json.dump([[list(t.shape), str(t.dtype)] for t in outs], f)
    return object()
