"""``gkbuild doctor``'s probe kernels, run in a process of its own (``python -m
gkbuild.compile.probes SPEC.json``, the Neuron SDK importable): a few lines of NKI each, compiled
through the same ``torch_neuronx.trace`` call a build makes (``neuron_trace.compile_traced``) and run
on the NeuronCore when one is present (else trace-only). What each saw goes to ``spec["out"]``:

- ``device``: whether a trace without ``cpu_backend`` finds a NeuronCore;
- ``dtypes``: the dtype a kernel sees for a torch.uint16 / float4_e2m1fn_x2 (MX tiles) and uint8 /
  float8_e8m0fnu (MX scales) argument, called by keyword; ``neffs``: the ``.neff`` files that trace
  left in its work folder;
- ``mixing``: whether a module holding a legacy-e4m3 tensor of the kernel's own next to an e4m3fn
  input compiles;
- ``aliases``: an in-place update of an argument, compiled without and with ``input_output_aliases``,
  each run twice on the device to see whether the update persists;
- ``saturation``: values 239..449 converted to e4m3 on the device (the parent runs this process
  again with ``NEURON_RT_ENABLE_OCP_SATURATION=1``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .neuron_trace import TraceError, compile_traced

SATURATION_VALUES = [239.0, 240.0, 241.0, 300.0, 448.0, 449.0, -300.0]
SEEN: dict = {}


def _kernels():
    import nki
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def dtype_probe(w_u16, w_fp4x2, s_u8, s_e8m0):
        SEEN.update({"uint16": str(w_u16.dtype), "float4_e2m1fn_x2": str(w_fp4x2.dtype), "uint8": str(s_u8.dtype),
                     "float8_e8m0fnu": str(s_e8m0.dtype)})
        return nl.ndarray((1,), dtype=nl.uint8, buffer=nl.shared_hbm)

    @nki.jit
    def mixing_probe(x):
        nl.ndarray((1,), dtype=nl.float8_e4m3, buffer=nl.sbuf)  # a scratch tensor of the legacy flavour
        return nl.ndarray((1,), dtype=nl.uint8, buffer=nl.shared_hbm)

    @nki.jit
    def update_probe(cache):
        nl.store(cache, nl.add(nl.load(cache), 1))
        return cache

    @nki.jit
    def saturation_probe(x):
        out = nl.ndarray(x.shape, dtype=nl.float8_e4m3, buffer=nl.shared_hbm)
        nisa.tensor_copy(dst=out, src=x)
        return out

    return dtype_probe, mixing_probe, update_probe, saturation_probe


def _try(fn, *a, **kw):
    try:
        return fn(*a, **kw), None
    except TraceError as e:
        return None, str(e)


def run(spec: dict) -> dict:
    import torch

    dtype_probe, mixing_probe, update_probe, saturation_probe = _kernels()
    work, args = Path(spec["workdir"]), spec["compiler_args"]
    res: dict = {}
    mx = [torch.zeros((4, 4), dtype=torch.uint16), torch.zeros((4, 4), dtype=torch.uint16).view(torch.float4_e2m1fn_x2),
          torch.zeros((4, 4), dtype=torch.uint8), torch.zeros((4, 4), dtype=torch.uint8).view(torch.float8_e8m0fnu)]
    names = ("w_u16", "w_fp4x2", "s_u8", "s_e8m0")
    by_keyword = lambda *ts: dtype_probe(**dict(zip(names, ts)))  # noqa: E731 - called as a build calls its kernels
    _, err = _try(compile_traced, by_keyword, mx, work / "device", args, "device")
    device = err is None
    res["device"] = {"present": device, "evidence": "a trace without cpu_backend compiled" if device else err}
    mode = "device" if device else "host"
    if spec.get("only") != "saturation":
        SEEN.clear()
        _, err = _try(compile_traced, by_keyword, mx, work / "dtypes", args, mode)
        res["dtypes"] = {"seen": dict(SEEN), "error": err}
        res["neffs"] = sorted(p.relative_to(work / "dtypes").as_posix() for p in (work / "dtypes").rglob("*.neff"))
        fn8 = torch.zeros((4,), dtype=torch.float8_e4m3fn)
        _, err = _try(compile_traced, mixing_probe, [fn8], work / "mixing", spec["mixing_args"], mode)
        res["mixing"] = {"compiled": err is None, "error": err}
        res["aliases"] = {}
        for declared in (False, True):
            cache = torch.zeros((4,), dtype=torch.float32)
            traced, err = _try(compile_traced, update_probe, [cache], work / f"aliases-{declared}", args, mode,
                               {cache: 0} if declared else None)
            after = None
            if traced is not None and device:  # a fresh cache: tracing may have run the kernel on the example
                state = torch.zeros((4,), dtype=torch.float32)
                for _ in range(2):
                    traced(state)
                after = float(state[0])
            res["aliases"]["declared" if declared else "undeclared"] = {"compiled": err is None, "error": err,
                                                                         "after_two_runs": after}
    if device:
        x = torch.tensor(SATURATION_VALUES, dtype=torch.float32)
        traced, err = _try(compile_traced, saturation_probe, [x], work / "saturation", args, mode)
        vals = None if traced is None else [float(v) for v in traced(x)]
        res["saturation"] = {"values": vals and [v if math.isfinite(v) else str(v) for v in vals], "error": err}
    return res


def sdk_imports() -> str | None:
    """Why the Neuron SDK, found on the path, does not import (a missing shared library, a
    mismatched torch), or None: found is not working, and every probe would fail alike."""
    import importlib

    from .neuron import SDK_MODULES

    for m in SDK_MODULES:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - whatever the SDK raises on import, in one line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return f"the Neuron SDK does not import ({m}: {type(e).__name__}: {msg[:300]})"
    return None


def main(argv: list[str]) -> int:
    from gkbuild.jsonio import read

    why = sdk_imports()
    if why:
        print(why, file=sys.stderr)
        return 1
    spec = read(argv[0], 1 << 20)
    Path(spec["out"]).write_text(json.dumps(run(spec), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
