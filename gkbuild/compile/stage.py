"""The compile stage of a build: trace the decode and tail programs and compile them.

cpu / cuda targets: the inductor backend (``compiled/{decode,tail}.pt2``, one dynamic-batch
program each). trn2 / trn3: the neuron backend, one NEFF a program and decode batch size
(``compiled/{decode,tail}-b<B>.neff``); without the Neuron SDK that part is recorded as
``skipped: Neuron SDK not installed`` and a warning says so (``require_neff`` makes it an error).

The stage's key is the compiler (name, version), each program's flags, signature and kernel
scalars, each program's kernel (library and revision, entry point, switch overrides, trace mode)
and the gkbuild version, like the Neuron persistent cache keys on HLO and flags: weights are graph
inputs, so new weights of the same shapes reuse the artifacts; a new compiler or kernel recompiles.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .. import __version__
from ..errors import GkError, os_error
from ..paths import inside
from ..pipeline.fingerprint import sha256_file
from ..pipeline.state import key
from ..progress import warn
from . import cache as compile_cache, hostprofile, inductor, neff, neuron, rules, signature

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
        e["kernel"] = kernel
    if path and (out / path).exists():
        e["size"], e["sha256"] = (out / path).stat().st_size, sha256_file(out / path)
    if sig.program in KV_UPDATE:
        e["kv_update"] = KV_UPDATE[sig.program]
    return e


@dataclass(frozen=True)
class Backend:
    """How a recipe's programs are compiled: the backend, its artifact format and suffix, the
    compiler, each program's flags and (NEFFs) kernel record, why this host cannot compile (None
    when it can), and, once ``prepare``d, each program's library checkout."""

    name: str
    fmt: str
    suffix: str
    target: str
    compiler: dict
    flags: dict  # program -> flags
    kernels: dict  # program -> kernel record (None for inductor)
    unavailable: str | None
    roots: dict | None = None  # program -> library checkout (``prepare``)
    profile: dict | None = None  # the host profile the neuron backend follows (``hostprofile.load``)

    def expect(self, program: str) -> dict:
        """What a cached artifact of ``program`` must say it is (``cache.CompileCache.restore``)."""
        return {"format": self.fmt, "target": self.target, "compiler": self.compiler, "flags": self.flags[program]}

    def kernel_key(self, program: str) -> dict | None:
        rec = self.kernels[program]
        return None if rec is None else neuron.key_of(rec)


def backend(plan) -> Backend:
    r = plan.recipe
    programs = ("decode", "tail")
    if r.backend == "inductor":
        return Backend("inductor", "aoti-pt2", "pt2", r.target, inductor.compiler(),
                       {p: inductor.flags(r.target, r.decode.batch_sizes) for p in programs},
                       {p: None for p in programs}, inductor.available(r.target))
    profile = hostprofile.of(r)
    kernels = {p: {**neuron.kernel(r, p), "host_profile": hostprofile.relied_on(r, p, profile)} for p in programs}
    return Backend("neuron", "neff", "neff", r.target, neuron.compiler(), {p: neuron.flags(r, p) for p in programs},
                   kernels, neuron.sdk(), profile=profile)


def prepare(plan, be: Backend) -> Backend:
    """NEFFs: each program's library checked out and its kernel record finished from the checkout
    (the switches the library reads, each set); inductor: as is."""
    if be.name != "neuron" or be.roots is not None:
        return be
    from ..checkpoint.source import cache_root

    _refuse(plan, be.profile)  # what gkbuild knows of the revision: before the checkout
    done = {p: neuron.prepare(plan.recipe, p, rec, cache_root()) for p, rec in be.kernels.items()}
    _refuse(plan, be.profile, {p: d[0] for p, d in done.items()})  # the checkout's own declarations: before any trace
    return replace(be, roots={p: d[0] for p, d in done.items()}, kernels={p: d[1] for p, d in done.items()})


def refuse_unbuildable(recipe, config) -> None:
    """A Neuron recipe whose programs ``gkbuild plan`` refuses is refused before a build writes
    anything, with or without the SDK (the same rules on the same plan, from the model config
    alone): plan and compile give the same one line."""
    if recipe.backend != "neuron":
        return
    from ..plan import make_plan

    _refuse(make_plan(recipe, config), hostprofile.of(recipe))


def _refuse(plan, profile: dict | None, roots: dict | None = None) -> None:
    why = rules.refusal(rules.plan_verdicts(plan, hostprofile.answers(profile), roots))
    if why:
        raise GkError(f"{plan.recipe.target}: {why}")


def program_keys(plan, be: Backend, sigs) -> dict[str, str]:
    """Each program's compile key (``cache.program_key``), by program name."""
    return {s.key: compile_cache.program_key(plan, s, be.compiler, be.flags[s.program], be.kernel_key(s.program))
            for s in sigs}


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
        be = prepare(plan, be)
        neuron.build(plan, sig, out, be.roots[sig.program], be.kernels[sig.program])
    return path


def artifact_entry(plan, sig, be: Backend, out: Path, path: str | None, status: str = "ok") -> dict:
    """The manifest's compile entry of one program (a NEFF's header read in)."""
    e = _entry(sig, be.fmt, path, out, be.target, be.compiler, be.flags[sig.program], status,
               be.kernels[sig.program])
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
    # a host that cannot compile (no Neuron SDK) still assembles a build the compile cache holds whole
    skipped = be.unavailable
    if skipped and cache and all(cache.holds(keys[s.key], s.key, be.expect(s.program)) for s in sigs):
        skipped = None
    k = key("compile", r.backend, r.target, be.compiler, be.flags,
            [[s.key, [i.to_dict() for i in s.inputs], list(s.outputs), s.scalars] for s in sigs],
            plan.scalars, asdict(r.tail), {p: be.kernel_key(p) for p in be.kernels}, skipped, __version__)
    paths = {s.key: artifact_path(be, s) for s in sigs}
    for p in paths.values():  # written and replaced below: never through a link
        inside(out, p)
    if skipped:
        status = f"skipped: {skipped}"
        if r.backend == "neuron" and require_neff:
            raise GkError(f"--require-neff: {skipped}; install the Neuron SDK (pip install 'gkbuild[neuron]' "
                          f"from the Neuron repository)")
        warn(f"{r.target} artifacts not compiled: {skipped}; everything else is built (the manifest records "
             f"the {r.backend} stage as skipped)")
        entries = [artifact_entry(plan, s, be, out, None, status) for s in sigs]
        return {"status": status, "backend": r.backend, "artifacts": entries, **_profile(be)}, k, "skipped", skipped
    overflows = hostprofile.answers(be.profile).get("fp8_saturation") == "inf"
    if overflows and r.kv_cache.dtype == "fp8" and r.kv_cache.packed:
        warn(f"host profile {be.profile['file']}: this device turns packed K beyond 240 into inf (doctor "
             f"fp8_saturation); keep |K| * k_scale within 240 (verify names a departure)")
    be = prepare(plan, be)  # the checkouts say which switches each library reads: every one is set
    # re-verified: an artifact edited since it was compiled is compiled (or restored) again
    cached = state.stages.get("compile") == k and all(
        (out / p).is_file() and sha256_file(out / p) == state.artifacts.get(p) for p in paths.values())
    t0 = time.perf_counter()
    if not cached:
        before_write()
        progress.task("compile", f"compile {len(sigs)} programs ({r.backend})", 0)
        for s in sigs:
            if not (cache and cache.restore(keys[s.key], s.key, out / paths[s.key], be.expect(s.program))):
                compile_program(plan, s, be, out, keys[s.key])
    entries = [artifact_entry(plan, s, be, out, paths[s.key]) for s in sigs]
    state.artifacts = {e["path"]: e["sha256"] for e in entries}
    if cache and cache.push_enabled:
        try:
            for e in entries:
                cache.push(keys[e["name"]], e["name"], out / e["path"], e)
        except (GkError, OSError) as err:  # the build is whole without it; a rerun does not compile again
            warn(f"compile cache: pushing to {cache.uri} failed ({os_error(err) if isinstance(err, OSError) else err}); "
                 f"the build is complete, its programs were not stored")
    detail = ", ".join(paths.values()) + ("" if cached else f" ({time.perf_counter() - t0:.0f} s)")
    if cache and cache.summary():
        detail += f"; {cache.summary()}"
    return ({"status": "ok", "backend": r.backend, "artifacts": entries, "cache_keys": keys, **_profile(be)}, k,
            "cached" if cached else "ran", detail)


def _profile(be: Backend) -> dict:
    """The manifest's record of the host profile a Neuron build followed ("unchecked" without one)."""
    return {"host_profile": hostprofile.record(be.profile)} if be.name == "neuron" else {}


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
