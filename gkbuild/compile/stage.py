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
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from ..errors import GkError, os_error
from ..paths import inside
from ..kernels.decode import Scalars
from ..pipeline.fingerprint import sha256_file
from ..pipeline.state import key
from ..progress import warn
from . import cache as compile_cache, conformance, inductor, neff, neuron, signature
from .programs import DecodeProgram, TailProgram

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


def run(plan, out: Path, state, progress, require_neff: bool = False, before_write=lambda: None, cache=None):
    """(manifest compile entry, stage key, status, detail) for the compile stage; ``before_write``
    is called before the first artifact is (re)written. ``cache``: a ``cache.CompileCache`` looked
    up before compiling a program (and pushed to after, if asked)."""
    r = plan.recipe
    sigs = signature.programs(plan)
    kernels = {p: None for p in ("decode", "tail")}
    if r.backend == "inductor":
        backend, fmt, suffix = inductor, "aoti-pt2", "pt2"
        flags = {p: inductor.flags(r.target, r.decode.batch_sizes) for p in kernels}
        unavailable = inductor.available(r.target)
    else:
        backend, fmt, suffix = neuron, "neff", "neff"
        flags = {p: neuron.flags(r, p) for p in kernels}
        unavailable = neuron.sdk()
        kernels = {p: neuron.kernel(r, p) for p in kernels}
    comp = backend.compiler()
    kernel_keys = {p: None if rec is None else neuron.key_of(rec) for p, rec in kernels.items()}
    k = key("compile", r.backend, r.target, comp, flags,
            [[s.key, [i.to_dict() for i in s.inputs], list(s.outputs), s.scalars] for s in sigs],
            plan.scalars, asdict(r.tail), kernel_keys, unavailable, __version__)
    paths = {s.key: f"{OUT}/{s.key}.{suffix}" for s in sigs}
    for p in paths.values():  # written and replaced below: never through a link
        inside(out, p)
    if unavailable:
        status = f"skipped: {unavailable}"
        if r.backend == "neuron" and require_neff:
            raise GkError(f"--require-neff: {unavailable}; install the Neuron SDK (pip install 'gkbuild[neuron]' "
                          f"from the Neuron repository)")
        warn(f"{r.target} artifacts not compiled: {unavailable}; everything else is built (the manifest records "
             f"the {r.backend} stage as skipped)")
        why = conformance.isa_refusal(r) if r.backend == "neuron" else None
        if why:
            warn(f"and they would not compile: {why}")
        entries = [_entry(s, fmt, None, out, r.target, comp, flags[s.program], status, kernels[s.program])
                   for s in sigs]
        return {"status": status, "backend": r.backend, "artifacts": entries}, k, "skipped", unavailable
    roots = {}
    if r.backend == "neuron":  # the checkouts say which switches each library reads: every one is set
        from ..checkpoint.source import cache_root

        why = conformance.isa_refusal(r)
        if why:
            raise GkError(f"{r.target}: {why}")

        for p in kernels:
            roots[p], kernels[p] = neuron.prepare(r, p, kernels[p], cache_root())
    # re-verified: an artifact edited since it was compiled is compiled (or restored) again
    cached = state.stages.get("compile") == k and all(
        (out / p).is_file() and sha256_file(out / p) == state.artifacts.get(p) for p in paths.values())
    keys = {s.key: compile_cache.program_key(plan, s, comp, flags[s.program], kernel_keys[s.program]) for s in sigs}
    t0 = time.perf_counter()
    if not cached:
        before_write()
        progress.task("compile", f"compile {len(sigs)} programs ({r.backend})", 0)
        for s in sigs:
            expect = {"format": fmt, "target": r.target, "compiler": comp, "flags": flags[s.program]}
            if cache and cache.restore(keys[s.key], s.key, out / paths[s.key], expect):
                continue
            if r.backend == "inductor":
                inductor.build(_program(plan, s), s, r.decode.batch_sizes, r.target, out / paths[s.key])
            else:
                neuron.build(plan, s, out, roots[s.program], kernels[s.program])
    entries = [_entry(s, fmt, paths[s.key], out, r.target, comp, flags[s.program], "ok", kernels[s.program])
               for s in sigs]
    state.artifacts = {e["path"]: e["sha256"] for e in entries}
    if r.backend == "neuron":
        for e in entries:
            e["neff"] = neff.read(out / e["path"]).to_dict()
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
    return ({"status": "ok", "backend": r.backend, "artifacts": entries, "cache_keys": keys}, k,
            "cached" if cached else "ran", detail)


def _program(plan, sig):
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
