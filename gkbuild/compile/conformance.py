"""Each Neuron program's argument set held to its kernel revision's published interface, before
anything is traced: every required parameter given, nothing given that the revision lacks.

The interface is the committed one (``interface.load``) when gkbuild knows the revision; for
another revision the same check runs in the trace process against the checked-out kernel
(``neuron_trace.check_arguments``). One line names the program, the revision and, where a recipe
form brought the argument in, the form.
"""

from __future__ import annotations

from ..errors import GkError
from . import kernel_source, signature

# Which recipe choice brings an optional argument in (for the message when a revision lacks it).
FORM_OF = {"kv_cache_update_idx_swa": "kv_cache.form: paired", "embed_weight": "decode.embedding",
           "embed_ids": "decode.embedding", "embed_x_shard_ids": "decode.embedding: hidden",
           "inv_freq": "decode.rope: fused", "rope_concentration": "decode.rope: fused",
           "k_scale": "kv_cache.dtype: fp8", "v_scale": "kv_cache.dtype: fp8",
           "expert_gate_up_weights_scale": "experts: mxfp4; bf16 experts have none",
           "expert_down_weights_scale": "experts: mxfp4; bf16 experts have none"}


def mismatch(params: list[dict], given: list[str]) -> tuple[list[str], list[str]]:
    """(required parameters not given, given names the kernel does not take)."""
    names = {p["name"] for p in params}
    missing = [p["name"] for p in params if p["required"] and p["name"] not in given]
    extra = [n for n in given if n not in names]
    return missing, extra


def check(plan) -> None:
    """Refuse, in one line, a Neuron program whose arguments its kernel revision does not take."""
    r = plan.recipe
    where = r.path or "recipe"
    for sig in signature.programs(plan):
        library, entry = kernel_source.chosen(r, sig.program)
        src = kernel_source.parse(library, r.path.parent if r.path else None, f"compile.kernels.{sig.program}.library")
        doc = kernel_source.interface(src)
        if doc is None:
            continue
        params = kernel_source.entry_parameters(doc, entry)
        if params is None:
            have = ", ".join(f"{e['module']}:{n}" for n, e in doc["entries"].items())
            raise GkError(f"{where}: compile.kernels.{sig.program}: {library} has no {entry} (it has {have})")
        missing, extra = mismatch(params, sig.names() + list(sig.scalars))
        if missing or extra:
            named = lambda ns: ", ".join(f"{n} ({FORM_OF[n]})" if n in FORM_OF else n for n in ns)  # noqa: E731
            why = "; ".join(([f"lacks {named(extra)}"] if extra else []) +
                            ([f"requires {named(missing)}"] if missing else []))
            forms = kernel_source.fork_forms(r)
            hint = (f"; {', '.join(forms)} need{'s' if len(forms) == 1 else ''} {kernel_source.F}"
                    if forms and library != kernel_source.F else "")
            raise GkError(f"{where}: the {sig.key} program does not fit {library}'s {entry.rpartition(':')[2]}: "
                          f"the kernel {why}{hint}")
