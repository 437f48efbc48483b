"""The Neuron backend: the GK decode and the sampling-tail NKI kernels compiled to LNC=1 NEFFs,
one per program and decode batch size (NEFF shapes are static).

What it runs for each program of a trn2/trn3 build (the Neuron SDK installed: torch-neuronx,
torch-xla, neuronx-cc, nki):

1. resolve the program's kernel (``compile.kernels.<program>``: a library pinned at a commit,
   cloned once into ``$GKBUILD_CACHE``, or a local folder, and an entry point), check the checkout
   against gkbuild's committed interface of that revision when there is one, and scan it for the
   ``VLLM_NEURON_MEGA_*`` switches it reads (``switches``: each is set explicitly);
2. trace and compile in a process of its own (``neuron_trace``) whose environment holds exactly
   those switches. The kernel is called on tensors of the signature's per-rank shapes and dtypes,
   its arguments first checked against its real signature. ``compile.trace``:

   - ``host`` (default): ``torch_neuronx.trace(fn, inputs, compiler_workdir=..., compiler_args=...,
     cpu_backend=True)`` with ``NEURON_PLATFORM_TARGET_OVERRIDE=<target>``: no NeuronCore needed.
     Both are AWS-documented: the torch-neuronx tracing API (``cpu_backend``, SDK 2.28+:
     frameworks/torch/torch-neuronx/api-reference-guide/inference/api-torch-neuronx-trace) and
     the target override for compiling without hardware (nki/api/generated/nki.jit;
     vllm-neuron/docs/design/compilation/cpu_compilation), both on awsdocs-neuron.readthedocs-hosted.com;
   - ``device``: the same ``torch_neuronx.trace`` on the host's NeuronCore;
   - ``xla-cpu``: torch-xla on ``PJRT_DEVICE=CPU``, the HLO proto written out, then the
     ``neuronx-cc compile --framework=XLA`` CLI. Not a documented Neuron compile mode: a warning
     says so whenever it is used.

   The compiler arguments (``flags``) are the same in every mode; on trn2 a decode with FP8 KV adds
   ``--experimental-unsafe-fp8e4m3fn-as-fp8e4m3`` (NCC_EVRF051: trn2 has no F8E4M3FN; K/V are
   carried as float8_e4m3fn saturated at +-240, whose bits are IEEE e4m3's);
3. the NEFF is moved into ``compiled/<program>-b<B>.neff`` only when the compiler has finished,
   and its header read into the manifest (``neff.read``).

One NEFF a program serves every rank (SPMD: ``rank_id`` is an input). Nothing of the SDK is imported
in this process; without it the stage is recorded as skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from ..errors import GkError
from ..progress import warn
from . import hostprofile, interface, kernel_source, switches
from .signature import Signature

COMPILER = "neuronx-cc"
SDK_MODULES = ("torch_neuronx", "torch_xla", "neuronxcc", "nki")
MESHES = ("tp_replica_group", "ep_replica_group")  # nki.collectives.ReplicaGroup arguments of the decode
FP8_ON_TRN2 = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"
# Never passed on from the caller: compiler flags come from the recipe; the compile mode sets its own.
UNSET = ("NEURON_CC_FLAGS", "PJRT_DEVICE", "NEURON_PLATFORM_TARGET_OVERRIDE")
UNVERIFIED = {"xla-cpu": "compile.trace: xla-cpu traces with torch-xla on PJRT_DEVICE=CPU, which AWS does not document "
                         "as a Neuron compile mode: unverified"}


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


def base_flags(target: str, level: int) -> list[str]:
    return [f"--target={target}", "--lnc=1", "--model-type=transformer", "--auto-cast=none", f"-O{level}"]


def flags(recipe, program: str = "decode") -> list[str]:
    """neuronx-cc arguments of one program (what ``torch_neuronx.trace`` is given as ``compiler_args``)."""
    f = base_flags(recipe.target, recipe.compile.optimization_level)
    if recipe.target == "trn2" and program == "decode" and recipe.kv_cache.dtype == "fp8":
        f.append(FP8_ON_TRN2)
    return f


def workdir(build_dir: Path) -> Path:
    from ..pipeline.state import STATE_DIR

    return Path(build_dir) / STATE_DIR / "neuron"


def invocation(sig: Signature, recipe, build_dir: Path) -> list[str]:
    """What compiles one program of a build in ``build_dir``, as a command line: the trace call
    (``host``/``device``) or the neuronx-cc CLI (``xla-cpu``)."""
    work, out = workdir(build_dir), Path(build_dir) / "compiled"
    args = flags(recipe, sig.program)
    if recipe.compile.trace == "xla-cpu":
        return [COMPILER, "compile", "--framework=XLA", str(work / f"{sig.key}.hlo.pb"), "--output",
                str(out / f"{sig.key}.neff"), *args, f"--logfile={work / f'{sig.key}.neuronx-cc.log'}"]
    env = [f"NEURON_PLATFORM_TARGET_OVERRIDE={recipe.target}"] if recipe.compile.trace == "host" else []
    return [*env, "torch_neuronx.trace", f"--cpu-backend={recipe.compile.trace == 'host'}",
            f"--compiler-workdir={work / sig.key}", f"--output={out / f'{sig.key}.neff'}", *args]


# -- the kernels ------------------------------------------------------------------------------------
def kernel(recipe, program: str) -> dict:
    """A program's kernel as the recipe resolves it, before any checkout: library and revision,
    entry point, the committed interface (if gkbuild has one for the revision), the switch
    settings that interface implies, and the trace mode."""
    base = recipe.path.parent if recipe.path else None
    library, entry = kernel_source.chosen(recipe, program)
    src = kernel_source.parse(library, base, f"compile.kernels.{program}.library")
    doc = kernel_source.interface(src)
    rec = {"library": library, "source": src.describe(), "revision": kernel_source.revision(src), "entry": entry,
           "interface": _interface_ref(doc), "trace": recipe.compile.trace,
           "switch_overrides": _asked(recipe, program)}
    rec["switches"] = _settings(recipe, program, doc["switches"], doc["flag_off_values"], partial=True) if doc else None
    return rec


def key_of(rec: dict) -> dict:
    """What of a kernel record a compiled program depends on (the full switch settings follow from
    the revision, the overrides and gkbuild's own code, which the program key holds)."""
    return {k: rec.get(k) for k in ("source", "revision", "entry", "trace", "switch_overrides", "host_profile")}


def _asked(recipe, program: str) -> dict[str, str]:
    """The recipe's switch overrides apply to the decode; the tail is traced on the reference path."""
    return switches.overrides(recipe.compile.kernel_switches) if program == "decode" else {}


def _settings(recipe, program, reads, off, partial: bool = False) -> dict:
    where = recipe.path or "recipe"
    return {s.name: s.to_dict() for s in switches.settings(reads, off, _asked(recipe, program), str(where), partial)}


def _interface_ref(doc: dict | None) -> dict | None:
    if doc is None:
        return None
    text = json.dumps(doc, sort_keys=True).encode()
    return {"file": interface.file_name(doc["repo"], doc["commit"]), "sha256": hashlib.sha256(text).hexdigest(),
            "files": doc["files"]}


def prepare(recipe, program: str, rec: dict, cache: Path) -> tuple[Path, dict]:
    """Check out a program's library and finish its kernel record from the checkout: the files the
    committed interface names must be the ones checked out, and every switch the library reads
    anywhere gets its explicit setting."""
    base = recipe.path.parent if recipe.path else None
    src = kernel_source.parse(rec["library"], base, f"compile.kernels.{program}.library")
    root = kernel_source.checkout(src, cache)
    for path, sha in ((rec["interface"] or {}).get("files") or {}).items():
        p = root / path
        got = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "missing"
        if got != sha:
            raise GkError(f"{rec['library']}: {path} in the checkout ({got[:12]}) is not the source gkbuild's "
                          f"interface {rec['interface']['file']} was read from ({sha[:12]})")
    reads, off, other = interface.scan_switches(root)
    return root, {**rec, "switches": _settings(recipe, program, reads, off), "unset": other}


def trace_environment(rec: dict, target: str, base: dict | None = None) -> dict[str, str]:
    """The trace process's environment: the caller's, less every kernel switch it happens to carry,
    the other variables the library reads (``unset``: they take their source defaults) and
    ``UNSET``, plus each of the program's switches set explicitly and the compile mode's variables."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(interface.SWITCH_PREFIX) and k not in UNSET and k not in rec.get("unset", ())}
    env.update({n: s["value"] for n, s in (rec["switches"] or {}).items()})
    if rec["trace"] == "host":
        env["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    elif rec["trace"] == "xla-cpu":
        env.update(NEURON_PLATFORM_TARGET_OVERRIDE=target, PJRT_DEVICE="CPU")
    return env


def trace_spec(sig: Signature, rec: dict, paths: list[str], work: Path, args: list[str]) -> dict:
    """What the trace process is given; the host profile's answers the program relies on (``rec``'s
    ``host_profile``) set the inputs' carrier dtypes, the K/V aliases and where the NEFF is taken from."""
    scalars = {k: (_lists(v) if k in MESHES or k == "hop_meshes" else v) for k, v in sig.scalars.items()}
    relied = rec.get("host_profile") or {}
    inputs = [{**i.to_dict(), "carrier": hostprofile.carrier(i.name, i.dtype, relied)} for i in sig.inputs]
    names = sig.names()
    aliases = ([[names.index(o["aliases"]), k] for k, o in enumerate(sig.outputs) if o.get("aliases")]
               if hostprofile.choice(relied, "kv_aliases") == "required" else [])
    return {"program": sig.program, "key": sig.key, "kernel": rec["entry"], "paths": paths, "mode": rec["trace"],
            "workdir": str(work / sig.key), "hlo": str(work / f"{sig.key}.hlo.pb"),
            "neff": str(work / f"{sig.key}.neff.partial"), "compiler_args": args, "inputs": inputs,
            "scalars": scalars, "replica_groups": [k for k in MESHES if k in scalars], "aliases": aliases,
            "neff_location": hostprofile.choice(relied, "neff_location")}


def _lists(v):
    return [_lists(x) for x in v] if isinstance(v, (list, tuple)) else v


def build(plan, sig: Signature, build_dir: Path, root: Path, rec: dict) -> Path:
    """Trace one program's kernel and compile it; returns the NEFF, under its final name only once
    the compiler has finished."""
    r = plan.recipe
    if rec["trace"] in UNVERIFIED:
        warn(UNVERIFIED[rec["trace"]])
    work = workdir(build_dir)
    work.mkdir(parents=True, exist_ok=True)
    (Path(build_dir) / "compiled").mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{sig.key}.trace.json"
    spec = trace_spec(sig, rec, kernel_source.import_roots(root), work, flags(r, sig.program))
    spec_path.write_text(json.dumps(spec, indent=1))
    tmp, final = Path(spec["neff"]), Path(build_dir) / "compiled" / f"{sig.key}.neff"
    tmp.unlink(missing_ok=True)
    try:
        done = subprocess.run([sys.executable, "-m", "gkbuild.compile.neuron_trace", str(spec_path)],
                              env=trace_environment(rec, r.target), capture_output=True, text=True)
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
            said = next((ln.removeprefix("gkbuild-trace: ") for ln in lines if ln.startswith("gkbuild-trace: ")),
                        lines[-1] if lines else "(no output)")
            raise GkError(f"{sig.key}: {said}{hostprofile.unchecked_hint(said, rec.get('host_profile') or {})}")
        if rec["trace"] == "xla-cpu":
            cmd = invocation(sig, r, build_dir)
            cmd[cmd.index("--output") + 1] = str(tmp)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
                raise GkError(f"neuronx-cc failed on {sig.key} (log: {cmd[-1].split('=', 1)[1]}): {last[0]}")
        if not tmp.is_file():
            raise GkError(f"{sig.key}: the compiler reported success but wrote no NEFF")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final
