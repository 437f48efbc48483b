"""Trace one Neuron program to HLO, in a process of its own: ``python -m gkbuild.compile.neuron_trace
SPEC.json``.

A process of its own because what the published kernels trace depends on the process: they read
switches from the environment while tracing (the decode's KV write-back), keep trace-scoped module
caches, and the SDK picks its device (a NeuronCore, or the host in the SDK's CPU compile mode,
``NEURON_PLATFORM_TARGET_OVERRIDE``) when torch_xla is first imported. The parent sets the
environment; this process imports the kernel from the recipe's ``compile.nki_library``, checks the
argument set against the kernel's real signature, calls it on XLA tensors shaped and typed as the
program's signature says, and writes the HLO module proto of its outputs.

Errors are one line on stderr (``gkbuild-trace: ...``) and exit status 3; the parent raises it.
"""

from __future__ import annotations

import importlib
import inspect
import sys


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


def tensor(spec: dict, device):
    """A zero tensor (or the build's constant) of the signature's shape and dtype on ``device``."""
    import torch

    name = spec["dtype"]
    dt = getattr(torch, name, None)
    if dt is None:
        raise TraceError(f"{spec['name']}: this torch has no dtype {name!r} (trn2 FP8 KV is IEEE-style float8_e4m3, "
                         f"max 240; OCP float8_e4m3fn fails NCC_EOCP001 there): use kv_cache.dtype: bf16, or "
                         f"target trn3")
    t = torch.zeros(spec["shape"], dtype=dt)
    if spec.get("value") is not None:
        t.fill_(spec["value"])
    return t.to(device)


def trace(spec: dict) -> bytes:
    kernel = load_kernel(spec["kernel"], spec["paths"])
    names = [i["name"] for i in spec["inputs"]] + list(spec["scalars"])
    check_arguments(kernel, names, spec["program"])
    import torch_xla
    import torch_xla.core.xla_model as xm
    from nki.collectives import ReplicaGroup

    device = xm.xla_device()
    tensors = {i["name"]: tensor(i, device) for i in spec["inputs"]}
    scalars = dict(spec["scalars"])
    for name in spec["meshes"]:
        v = scalars[name]
        scalars[name] = tuple(ReplicaGroup(m) for m in v) if name == "hop_meshes" else ReplicaGroup(v)
    try:
        outs = kernel(**tensors, **scalars)
    except Exception as e:  # noqa: BLE001 - the kernel's own assertion, said in one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TraceError(f"the {spec['program']} kernel refused its arguments: {type(e).__name__}: {msg}") from None
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    return bytes(torch_xla._XLAC._get_xla_tensors_hlo_proto(outs))


def main(argv: list[str]) -> int:
    from gkbuild.jsonio import read

    spec = read(argv[0], 1 << 20)
    try:
        hlo = trace(spec)
    except TraceError as e:
        print(f"gkbuild-trace: {e}", file=sys.stderr)
        return 3
    with open(spec["hlo"], "wb") as f:
        f.write(hlo)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
