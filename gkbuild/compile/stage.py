"""The compile stage of a build: trace the decode and tail programs and compile them.

cpu / cuda targets: the inductor backend (``compiled/{decode,tail}.pt2``, one dynamic-batch
program each). trn2 / trn3: the neuron backend, one NEFF a program and decode batch size
(``compiled/{decode,tail}-b<B>.neff``); without the Neuron SDK that part is recorded as
``skipped: Neuron SDK not installed`` and a warning says so (``require_neff`` makes it an error).

The stage's key is the compiler (name, version), its flags, every program's signature and kernel
scalars, the kernels (entry points, source and revision, trace-time switches, trace mode) and the
gkbuild version, like the Neuron persistent cache keys on HLO and flags: weights are graph inputs,
so new weights of the same shapes reuse the artifacts; a new compiler or kernel recompiles.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import __version__
from ..errors import GkError
from ..pipeline.fingerprint import sha256_file
from ..pipeline.state import key
from ..progress import warn
from . import cache as compile_cache, inductor, kernel_source, neff, neuron, signature

OUT = "compiled"
KV_UPDATE = {"decode": "in-place: the program writes the new token's K/V into the K/V buffers it is given"}


def _entry(sig, fmt: str, path: str | None, out: Path, target: str, comp: dict, flags: list[str],
           status: str, kernel: dict | None) -> dict:
    e = {"name": sig.key, "program": sig.program, "batch_size": sig.batch, "format": fmt, "path": path,
         "size": None, "sha256": None, "target": target, "compiler": comp, "flags": flags,
         "inputs": [i.to_dict() for i in sig.inputs], "outputs": list(sig.outputs), "status": status}
    if sig.scalars:
        e["scalars"] = sig.scalars
    if kernel is not None:
        e["kernel"] = {"entry": kernel[sig.program], "source": kernel["source"], "revision": kernel["revision"],
                       "switches": kernel["switches"], "trace": kernel["trace"]}
    if path and (out / path).exists():
        e["size"], e["sha256"] = (out / path).stat().st_size, sha256_file(out / path)
    if sig.program in KV_UPDATE:
        e["kv_update"] = KV_UPDATE[sig.program]
    return e


@dataclass(frozen=True)
class Backend:
    """How a recipe's programs are compiled: the backend, its artifact format and suffix, the
    compiler and its flags, why this host cannot compile (None when it can), and for NEFFs the
    kernel source and the kernel record."""

    name: str
    fmt: str
    suffix: str
    compiler: dict
    flags: list
    unavailable: str | None
    source: object = None
    kernel: dict | None = None

    @property
    def expect(self) -> dict:
        """What a cached artifact of this backend must say it is (``cache.CompileCache.restore``)."""
        return {"format": self.fmt, "compiler": self.compiler, "flags": self.flags}


def backend(plan) -> Backend:
    r = plan.recipe
    if r.backend == "inductor":
        return Backend("inductor", "aoti-pt2", "pt2", inductor.compiler(),
                       inductor.flags(r.target, r.decode.batch_sizes), inductor.available(r.target))
    source = kernel_source.parse(r.compile.nki_library, r.path.parent if r.path else None)
    return Backend("neuron", "neff", "neff", neuron.compiler(), neuron.flags(r), neuron.sdk(), source,
                   neuron.kernel_record(r, source))


def program_keys(plan, be: Backend, sigs) -> dict[str, str]:
    """Each program's compile key (``cache.program_key``), by program name."""
    return {s.key: compile_cache.program_key(plan, s, be.compiler, be.flags, be.kernel) for s in sigs}


def artifact_path(be: Backend, sig) -> str:
    return f"{OUT}/{sig.key}.{be.suffix}"


def compile_program(plan, sig, be: Backend, out: Path, key: str) -> Path:
    """Trace and compile one program into ``out/compiled/`` (the build folder, or a farm job's own
    folder); returns the artifact. Needs only the plan and the kernel source: no weights."""
    r = plan.recipe
    if be.unavailable:
        raise GkError(f"{sig.key}: cannot compile for {r.target} here: {be.unavailable}")
    path = out / artifact_path(be, sig)
    if be.name == "inductor":
        inductor.build(_program(plan, sig), sig, r.decode.batch_sizes, r.target, path, key)
    else:
        from ..checkpoint.source import cache_root

        neuron.build(plan, sig, out, be.source, cache_root())
    return path


def artifact_entry(plan, sig, be: Backend, out: Path, path: str | None, status: str = "ok") -> dict:
    """The manifest's compile entry of one program (a NEFF's header read in)."""
    e = _entry(sig, be.fmt, path, out, plan.recipe.target, be.compiler, be.flags, status, be.kernel)
    if be.name == "neuron" and path:
        e["neff"] = neff.read(out / path).to_dict()
    return e


def run(plan, out: Path, state, progress, require_neff: bool = False, before_write=lambda: None, cache=None):
    """(manifest compile entry, stage key, status, detail) for the compile stage; ``before_write``
    is called before the first artifact is (re)written. ``cache``: a ``cache.CompileCache`` looked
    up before compiling a program (and pushed to after, if asked)."""
    r = plan.recipe
    sigs = signature.programs(plan)
    be = backend(plan)
    keys = program_keys(plan, be, sigs)
    expect = dict(be.expect, target=r.target)
    # a host that cannot compile (no Neuron SDK) still assembles a build the compile cache holds whole
    skipped = be.unavailable
    if skipped and cache and all(cache.holds(keys[s.key], s.key, expect) for s in sigs):
        skipped = None
    k = key("compile", r.backend, r.target, be.compiler, be.flags,
            [[s.key, [i.to_dict() for i in s.inputs], list(s.outputs), s.scalars] for s in sigs],
            plan.scalars, asdict(r.tail), be.kernel, skipped, __version__)
    paths = {s.key: artifact_path(be, s) for s in sigs}
    if skipped:
        status = f"skipped: {skipped}"
        if r.backend == "neuron" and require_neff:
            raise GkError(f"--require-neff: {skipped}; install the Neuron SDK (pip install 'gkbuild[neuron]' "
                          f"from the Neuron repository)")
        warn(f"{r.target} artifacts not compiled: {skipped}; everything else is built (the manifest records "
             f"the {r.backend} stage as skipped)")
        entries = [artifact_entry(plan, s, be, out, None, status) for s in sigs]
        return {"status": status, "backend": r.backend, "artifacts": entries}, k, "skipped", skipped
    cached = state.stages.get("compile") == k and all((out / p).exists() for p in paths.values())
    t0 = time.perf_counter()
    if not cached:
        before_write()
        progress.task("compile", f"compile {len(sigs)} programs ({r.backend})", 0)
        for s in sigs:
            if not (cache and cache.restore(keys[s.key], s.key, out / paths[s.key], expect)):
                compile_program(plan, s, be, out, keys[s.key])
    entries = [artifact_entry(plan, s, be, out, paths[s.key]) for s in sigs]
    if cache and cache.push_enabled:
        for e in entries:
            cache.push(keys[e["name"]], e["name"], out / e["path"], e)
    detail = ", ".join(paths.values()) + ("" if cached else f" ({time.perf_counter() - t0:.0f} s)")
    if cache and cache.summary():
        detail += f"; {cache.summary()}"
    return ({"status": "ok", "backend": r.backend, "artifacts": entries, "cache_keys": keys}, k,
            "cached" if cached else "ran", detail)


def _program(plan, sig):
    from ..kernels.decode import Scalars
    from .programs import DecodeProgram, TailProgram

    if sig.program == "decode":
        return DecodeProgram(sig, Scalars.from_plan(plan, ep_rank=0), plan.kv)
    s = plan.scalars
    return TailProgram(plan.recipe.tail.k, s["eps"], s["hidden_actual"], plan.recipe.tail.emit_logits)


def invocations(plan, out: Path) -> list[str]:
    """What the compile stage will run for this plan, one line a program (``plan --show-compile``):
    the neuronx-cc command line, or the in-process AOTInductor compile and its flags."""
    import shlex

    r = plan.recipe
    if r.backend == "neuron":
        return [shlex.join(neuron.invocation(s, r, out)) for s in signature.programs(plan)]
    return [f"torch.export.export({type(_program(plan, s)).__name__}) -> torch._inductor.aoti_compile_and_package "
            f"-> {out / OUT}/{s.key}.pt2  [{' '.join(inductor.flags(r.target, r.decode.batch_sizes))}]"
            for s in signature.programs(plan)]
