"""The Neuron backend: the GK decode and the sampling-tail NKI kernels compiled to LNC=1 NEFFs,
one per program and decode batch size (NEFF shapes are static).

What it runs for each program of a trn2/trn3 build (the Neuron SDK installed: torch-neuronx,
torch-xla, neuronx-cc, nki):

1. resolve ``compile.nki_library`` (a pinned git commit, cloned once into ``$GKBUILD_CACHE``, or a
   local folder) and its import roots (``kernel_source``);
2. trace in a process of its own (``neuron_trace``), with an environment holding exactly the
   recipe's ``compile.kernel_switches`` among the kernels' ``VLLM_NEURON_MEGA_*`` switches (KV
   write-back on), and, with ``compile.trace: host`` (the default), the SDK's CPU compile mode
   (``NEURON_PLATFORM_TARGET_OVERRIDE=<target>``, ``PJRT_DEVICE=CPU``: no NeuronCore needed, so a
   plain x86 CI runner with the SDK compiles NEFFs). It imports ``compile.kernels.<program>``,
   checks the argument set against the kernel's real signature (one line naming what is missing or
   extra), calls the kernel on XLA tensors of the signature's per-rank shapes and dtypes, and
   writes the HLO module proto to ``.gkbuild/neuron/<program>-b<B>.hlo.pb``;
3. run ``invocation(...)`` (printed by ``gkbuild plan --show-compile``):
       neuronx-cc compile --framework=XLA <hlo> --output compiled/<program>-b<B>.neff
         --target=<trn2|trn3> --lnc=1 --model-type=transformer --auto-cast=none -O<level>
         --logfile=.gkbuild/neuron/<program>-b<B>.neuronx-cc.log
4. read the NEFF header (``neff.read``) into the manifest.

One NEFF a program serves every rank (SPMD: ``rank_id`` is an input). Nothing of the SDK is imported
in this process; without it the stage is recorded as skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from ..errors import GkError
from . import kernel_source
from .signature import Signature

COMPILER = "neuronx-cc"
SDK_MODULES = ("torch_neuronx", "torch_xla", "neuronxcc", "nki")
SWITCH_PREFIX = "VLLM_NEURON_MEGA_"  # the published kernels' trace-time switches
MESHES = ("tp_replica_group", "ep_replica_group", "hop_meshes")


def sdk() -> str | None:
    """None when the Neuron SDK is importable, else why not (nothing is imported)."""
    missing = [m for m in SDK_MODULES if importlib.util.find_spec(m) is None]
    return f"Neuron SDK not installed (no {', '.join(missing)})" if missing else None


def compiler() -> dict:
    try:
        version = metadata.version("neuronx-cc")
    except metadata.PackageNotFoundError:
        version = None
    return {"name": COMPILER, "version": version}


def flags(recipe) -> list[str]:
    return [f"--target={recipe.target}", "--lnc=1", "--model-type=transformer", "--auto-cast=none",
            f"-O{recipe.compile.optimization_level}"]


def workdir(build_dir: Path) -> Path:
    from ..pipeline.state import STATE_DIR

    return Path(build_dir) / STATE_DIR / "neuron"


def invocation(sig: Signature, recipe, build_dir: Path) -> list[str]:
    """The exact neuronx-cc command line for one program of a build in ``build_dir``."""
    work, out = workdir(build_dir), Path(build_dir) / "compiled"
    return [COMPILER, "compile", "--framework=XLA", str(work / f"{sig.key}.hlo.pb"), "--output",
            str(out / f"{sig.key}.neff"), *flags(recipe), f"--logfile={work / f'{sig.key}.neuronx-cc.log'}"]


def switches(recipe) -> dict[str, str]:
    return dict(sw.partition("=")[::2] for sw in recipe.compile.kernel_switches)


def trace_environment(recipe, base: dict | None = None) -> dict[str, str]:
    """The trace process's environment: the caller's, less any kernel switch it happens to carry,
    plus the recipe's switches (and the CPU compile mode for ``trace: host``)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(SWITCH_PREFIX)}
    env.update(switches(recipe))
    if recipe.compile.trace == "host":
        env.update(NEURON_PLATFORM_TARGET_OVERRIDE=recipe.target, PJRT_DEVICE="CPU")
    return env


def kernel_entry(recipe, program: str) -> str:
    return getattr(recipe.compile.kernels, program)


def kernel_record(recipe, source: kernel_source.KernelSource) -> dict:
    """What the manifest and the compile key say about the kernels compiled."""
    return {"source": source.describe(), "revision": kernel_source.revision(source),
            "decode": recipe.compile.kernels.decode, "tail": recipe.compile.kernels.tail,
            "switches": switches(recipe), "trace": recipe.compile.trace}


def trace_spec(sig: Signature, entry: str, paths: list[str], hlo: Path) -> dict:
    scalars = {k: (_lists(v) if k in MESHES else v) for k, v in sig.scalars.items()}
    return {"program": sig.program, "kernel": entry, "paths": paths, "hlo": str(hlo),
            "inputs": [i.to_dict() for i in sig.inputs], "scalars": scalars,
            "meshes": [k for k in MESHES if k in scalars]}


def _lists(v):
    return [_lists(x) for x in v] if isinstance(v, (list, tuple)) else v


def build(plan, sig: Signature, build_dir: Path, source: kernel_source.KernelSource, cache: Path) -> Path:
    """Trace one program's kernel to HLO and compile it with neuronx-cc; returns the NEFF."""
    r = plan.recipe
    root = kernel_source.checkout(source, cache)
    work = workdir(build_dir)
    work.mkdir(parents=True, exist_ok=True)
    (Path(build_dir) / "compiled").mkdir(parents=True, exist_ok=True)
    hlo = work / f"{sig.key}.hlo.pb"
    spec_path = work / f"{sig.key}.trace.json"
    spec_path.write_text(json.dumps(trace_spec(sig, kernel_entry(r, sig.program), kernel_source.import_roots(root),
                                               hlo), indent=1))
    done = subprocess.run([sys.executable, "-m", "gkbuild.compile.neuron_trace", str(spec_path)],
                          env=trace_environment(r), capture_output=True, text=True)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
        said = next((ln.removeprefix("gkbuild-trace: ") for ln in lines if ln.startswith("gkbuild-trace: ")),
                    lines[-1] if lines else "(no output)")
        raise GkError(f"{sig.key}: {said}")
    cmd = invocation(sig, r, build_dir)
    final = Path(cmd[cmd.index("--output") + 1])
    tmp = work / f"{sig.key}.neff.partial"  # the NEFF appears under its name only when complete
    cmd[cmd.index("--output") + 1] = str(tmp)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise GkError(f"neuronx-cc failed on {sig.key} (log: {cmd[-1].split('=', 1)[1]}): {last[0]}")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final
