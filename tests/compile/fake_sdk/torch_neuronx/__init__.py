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
``compiler_workdir`` and, for the tests, what the program returned (``outputs.json``), and returns
the traced program, which runs only where a NeuronCore is (``GK_FAKE_NEURON_DEVICE=1``).

What AWS does not document is switchable, one environment variable a question (gkbuild doctor's
items), the first value the default:
- ``GK_FAKE_E4M3_MIXING`` accept | refuse: whether a module holding legacy ``float8_e4m3`` (declared
  by the kernel, ``nki.language.ndarray``) next to OCP ``float8_e4m3fn`` (an operand, or declared,
  ``_x4`` included) is refused as NCC_EOCP001 documents ("one E4M3 conversion mode per module"). On
  trn1/trn2 with the NCC_EVRF051 flag the e4m3fn operands are converted, so they do not count.
- ``GK_FAKE_KV_ALIASES`` implicit | required: whether an output that is an input updated in place
  must be declared in ``input_output_aliases`` ({input tensor: output index}). Required: the trace
  refuses an undeclared one (on such a host the update would silently not persist), and the traced
  program run without it leaves the caller's tensor unchanged.
- ``GK_FAKE_NEFF_LOCATION`` workdir | copies: the NEFF at ``compiler_workdir/graph.neff`` only, or
  also a copy at ``compiler_workdir/cache/graph.neff``.
- ``GK_FAKE_MX_CARRIER`` / ``GK_FAKE_MX_SCALE_CARRIER`` (``nki.language.presented``) and
  ``GK_FAKE_FP8_SATURATION`` (``nki.isa.tensor_copy``).
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
    aliases = _aliases(input_output_aliases, example_inputs)
    with open(os.environ["GK_FAKE_SDK_LOG"], "a") as f:
        f.write(json.dumps({"cpu_backend": cpu_backend, "target": override, "pjrt": os.environ.get("PJRT_DEVICE"),
                            "args": args, "switches": switches, "aliases": sorted(aliases.items()),
                            "dtypes": [str(t.dtype).removeprefix("torch.") for t in example_inputs]}) + "\n")
    from nki import language

    del language._declared[:]
    outs = func(*example_inputs)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    tensors = list(example_inputs) + list(outs)
    if target in ("trn1", "trn2") and any(t.dtype == torch.float8_e4m3fn for t in tensors) and FP8_FLAG not in args:
        raise RuntimeError("NCC_EVRF051: Data type F8E4M3FN is not supported on TRN1/TRN2.")
    converted = target in ("trn1", "trn2") and FP8_FLAG in args
    ocp = [d for d in language._declared if d.startswith("float8_e4m3fn")]
    ocp += [] if converted else ["float8_e4m3fn"] * any(t.dtype == torch.float8_e4m3fn for t in tensors)
    if os.environ.get("GK_FAKE_E4M3_MIXING", "accept") == "refuse" and "float8_e4m3" in language._declared and ocp:
        raise RuntimeError(f"NCC_EOCP001: the module holds float8_e4m3 and {ocp[0]} tensors; a module selects one "
                           f"E4M3 conversion mode")
    inplace = [(k, i) for i, o in enumerate(outs) for k, t in enumerate(example_inputs) if o is t]
    if os.environ.get("GK_FAKE_KV_ALIASES", "implicit") == "required":
        undeclared = [(k, i) for k, i in inplace if aliases.get(k) != i]
        if undeclared:
            raise RuntimeError(f"output {undeclared[0][1]} updates input {undeclared[0][0]} in place but "
                               f"input_output_aliases does not declare it")
    from tests.compile.neff_files import make

    neffs = ["graph.neff"] + (["cache/graph.neff"] if os.environ.get("GK_FAKE_NEFF_LOCATION") == "copies" else [])
    for rel in neffs:
        os.makedirs(os.path.dirname(os.path.join(compiler_workdir, rel)), exist_ok=True)
        with open(os.path.join(compiler_workdir, rel), "wb") as f:
            f.write(make(name="graph", lnc=1))
    with open(os.path.join(compiler_workdir, "outputs.json"), "w") as f:
        json.dump([[list(t.shape), str(t.dtype)] for t in outs], f)
    return _Traced(func, aliases)


def _aliases(given, inputs) -> dict:
    """{input index: output index}; every key one of the example inputs."""
    out = {}
    for t, i in dict(given).items():
        k = next((k for k, x in enumerate(inputs) if x is t), None)
        if k is None or not isinstance(i, int):
            raise ValueError("input_output_aliases maps example input tensors to output indices")
        out[k] = i
    return out


class _Traced:
    """The traced program: runs ``func`` on the NeuronCore (the CPU, where GK_FAKE_NEURON_DEVICE=1).
    Where aliases are required, an input updated in place without one is not updated."""

    def __init__(self, func, aliases):
        self.func, self.aliases = func, aliases

    def __call__(self, *inputs):
        if not os.environ.get("GK_FAKE_NEURON_DEVICE"):
            raise RuntimeError("no Neuron device found")
        if os.environ.get("GK_FAKE_KV_ALIASES", "implicit") == "required":
            inputs = [t if k in self.aliases else t.clone() for k, t in enumerate(inputs)]
        return self.func(*inputs)
