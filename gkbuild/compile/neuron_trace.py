"""Trace and compile one Neuron program, in a process of its own: ``python -m
gkbuild.compile.neuron_trace SPEC.json``.

A process of its own because what the published kernels trace depends on the process: they read
switches from the environment while tracing (and some at import), keep trace-scoped module caches,
and the SDK picks its target when first imported. The parent sets the environment; this process
imports the kernel from its library's import roots, checks the argument set against the kernel's
real signature, and compiles the kernel called on tensors shaped and typed as the program's
signature says:

- ``host`` / ``device``: ``torch_neuronx.trace`` (``cpu_backend=True`` for ``host``) with the
  build's compiler arguments; the NEFF the compiler leaves in the work folder is copied to
  ``spec["neff"]``;
- ``xla-cpu``: the outputs' HLO module proto (torch-xla) is written to ``spec["hlo"]`` for the
  neuronx-cc CLI.

The decode's ``tp_replica_group`` / ``ep_replica_group`` are ``nki.collectives.ReplicaGroup``
objects (its annotation); the tail's ``hop_meshes`` stay tuples of rank tuples: the tail reads
``len(mesh[0])`` and builds each ``ncc.ReplicaGroup`` itself.

Errors are one line on stderr (``gkbuild-trace: ...``) and exit status 3; the parent raises it.
"""

from __future__ import annotations

import importlib
import inspect
import shutil
import sys
from pathlib import Path


class TraceError(Exception):
    pass


def load_kernel(entry: str, paths: list[str]):
    """``module:function`` from the library's import roots (put first on sys.path)."""
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    module, _, name = entry.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise TraceError(f"{entry} is not importable from {paths}: {type(e).__name__}: {e}") from None


def parameters(kernel) -> tuple[list[str], list[str], bool]:
    """(required, optional, takes **kwargs) of a kernel, looking through jit wrappers."""
    fn = kernel
    for attr in ("__wrapped__", "func", "fn", "kernel"):
        inner = getattr(fn, attr, None)
        if callable(inner):
            fn = inner
            break
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as e:
        raise TraceError(f"cannot read the kernel's signature: {e}") from None
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    optional = [p.name for p in params if p.default is not inspect.Parameter.empty]
    return required, optional, any(p.kind == p.VAR_KEYWORD for p in params)


def check_arguments(kernel, given: list[str], program: str) -> None:
    """The argument set against the kernel's real signature: nothing missing, nothing extra."""
    required, optional, var_kw = parameters(kernel)
    missing = [n for n in required if n not in given]
    extra = [] if var_kw else [n for n in given if n not in required and n not in optional]
    if missing or extra:
        parts = ([f"missing {missing}"] if missing else []) + ([f"does not take {extra}"] if extra else [])
        raise TraceError(f"the {program} kernel's signature does not match the build's arguments: "
                         f"{'; '.join(parts)}")


def tensor(spec: dict):
    """A zero CPU tensor (or the build's constant) of the signature's shape and dtype, viewed as its
    ``carrier`` dtype where the host profile names one (MX tiles as torch.float4_e2m1fn_x2...)."""
    import torch

    name = spec["dtype"]
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TraceError(f"{spec['name']}: torch has no dtype {name!r}")
    t = torch.zeros(spec["shape"], dtype=dt)
    if spec.get("value") is not None:
        t.fill_(spec["value"])
    if spec.get("carrier"):
        t = t.view(getattr(torch, spec["carrier"]))
    return t


def compile_traced(fn, inputs, work: Path, args: list[str], mode: str, aliases: dict | None = None):
    """The one ``torch_neuronx.trace`` call gkbuild makes, for a build's programs and for ``gkbuild
    doctor``'s probes alike: into a fresh ``work`` folder, ``cpu_backend`` for the host mode,
    ``input_output_aliases`` ({input tensor: output index}) where asked. Returns the traced program."""
    import torch_neuronx

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        return torch_neuronx.trace(fn, tuple(inputs), input_output_aliases=dict(aliases or {}),
                                   compiler_workdir=str(work), compiler_args=list(args), cpu_backend=mode == "host")
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - the SDK's or the compiler's error, said in one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TraceError(f"torch_neuronx.trace failed: {type(e).__name__}: {msg[:500]}") from None


def the_neff(work: Path, pattern: str | None = None) -> Path:
    """The NEFF the compiler left in ``work``: the one file the host profile's ``neff_location``
    pattern names, else the one ``.neff`` anywhere under it."""
    neffs = sorted(work.glob(pattern)) if pattern else sorted(work.rglob("*.neff"))
    if len(neffs) != 1:
        where = f"at {pattern}" if pattern else "anywhere"
        raise TraceError(f"expected one NEFF {where} in the compiler's work folder {work}, found {len(neffs)}"
                         + ("" if pattern else ": " + ", ".join(str(n.relative_to(work)) for n in neffs)))
    return neffs[0]


def _call(kernel, spec: dict, names: list[str], scalars: dict, tensors):
    try:
        outs = kernel(**dict(zip(names, tensors)), **scalars)
    except Exception as e:  # noqa: BLE001 - the kernel's own assertion, said in one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TraceError(f"the {spec['program']} kernel refused its arguments: {type(e).__name__}: {msg}") from None
    return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)


def trace(spec: dict) -> None:
    kernel = load_kernel(spec["kernel"], spec["paths"])
    names = [i["name"] for i in spec["inputs"]]
    check_arguments(kernel, names + list(spec["scalars"]), spec["program"])
    from nki.collectives import ReplicaGroup

    scalars = dict(spec["scalars"])
    for name in spec["replica_groups"]:
        scalars[name] = ReplicaGroup(tuple(tuple(g) for g in scalars[name]))
    if "hop_meshes" in scalars:
        scalars["hop_meshes"] = tuple(tuple(tuple(g) for g in mesh) for mesh in scalars["hop_meshes"])
    inputs = [tensor(i) for i in spec["inputs"]]
    if spec["mode"] == "xla-cpu":
        import torch_xla
        import torch_xla.core.xla_model as xm

        device = xm.xla_device()
        outs = _call(kernel, spec, names, scalars, [t.to(device) for t in inputs])
        Path(spec["hlo"]).write_bytes(bytes(torch_xla._XLAC._get_xla_tensors_hlo_proto(list(outs))))
        return
    work = Path(spec["workdir"])
    aliases = {inputs[k]: o for k, o in spec.get("aliases", [])}
    compile_traced(lambda *ts: _call(kernel, spec, names, scalars, ts), inputs, work, spec["compiler_args"],
                   spec["mode"], aliases)
    shutil.copyfile(the_neff(work, spec.get("neff_location")), spec["neff"])


def main(argv: list[str]) -> int:
    from gkbuild.jsonio import read

    spec = read(argv[0], 1 << 20)
    try:
        trace(spec)
    except TraceError as e:
        print(f"gkbuild-trace: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
