"""The GK kernels' trace-time switches: every ``VLLM_NEURON_MEGA_*`` variable a revision reads, what
each does, and the value gkbuild sets for every one of them.

The published revisions read their switches differently. aws-neuron/nki-library@e9ef98fc reads
``bool(os.environ.get(NAME))``: absent or empty is off, and even "0" is ON. The fork
baonudesifeizhai/nki-library@9f2490f6 reads most through ``mega_flag_default_on``: absent is ON,
off only for one of ``_FLAG_OFF_VALUES`` ("", "0", "false", "False"). An unset switch therefore
means opposite things in the two, and some of F's defaults change numerics (an FP8 EP
reduce-scatter, MXFP8-quantized MoE activations) or the HBM layout a weight must have
(``SCALE_PACK64``). So gkbuild never leaves one unset: it sets every switch the revision reads
(:func:`scan` of the checked-out library, or its committed interface) to the kernel's reference
path, the path gkbuild's layouts and twins model:

- ``VLLM_NEURON_MEGA_KV_UPDATE`` on: the decode step writes its token's K/V (required);
- every other on/off switch off: "" for a ``bool(environ.get())`` read, "0" for a default-on one;
- a value switch at the source's own default ("" where it has none).

A recipe turns switches on with ``compile.kernel_switches: [NAME=VALUE, ...]``; each must be one the
revision reads. One whose effect would make the build's layouts wrong is refused; one that changes
numerics is compiled as asked, recorded, and named by ``verify`` as a path the twins do not model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import GkError

KV_UPDATE = "VLLM_NEURON_MEGA_KV_UPDATE"
DEFAULT_OFF = ["", "0", "false", "False"]  # mega_flag_default_on's off values when the source has none
# What each known switch does, in gkbuild's words from the source comments (the site is in the
# revision's interface): exact (data movement or scheduling; the values are unchanged), lossy
# (numerics the twins do not model), layout (expects weights in a layout gkbuild does not emit) or
# required.
CATALOGUE = {
    KV_UPDATE: ("required", "write the step's K/V into K_cache/V_cache in place and return them (aliased)"),
    "VLLM_NEURON_MEGA_FP8_RS": ("lossy", "the EP reduce-scatter moves FP8 partials (half the bytes)"),
    "VLLM_NEURON_MEGA_FP8_RS_SCALE": ("lossy", "the scale applied to the FP8 reduce-scatter's partials"),
    "VLLM_NEURON_MEGA_FUSE_RESID2": ("lossy", "fold the second residual add into the FP8 reduce-scatter's "
                                              "dequantization (only on the FP8_RS path)"),
    "VLLM_NEURON_MEGA_PREQUANT_MOE": ("lossy", "RMSNorm + MX (MXFP8) quantization + router run per token before "
                                               "the EP all-gather, which then moves quantized rows"),
    "VLLM_NEURON_MEGA_PREQUANT_AFF16": ("lossy", "the pre-quantized rows carry the router affinities in 16 bits"),
    "VLLM_NEURON_MEGA_SCALE_PACK64": ("layout", "read the gate/up MX scales as [E_L, 2, 64, H/512, I/4] (64 SBUF "
                                                "partitions); gkbuild writes [E_L, 16, 2, H/512, I]"),
    "VLLM_NEURON_MEGA_SCALE_PACK64_EXT": ("layout", "partition extent of the packed scale access (only with "
                                                    "SCALE_PACK64); 'rest' is the source's correct default"),
    "VLLM_NEURON_MEGA_SBUF_INTERLAYER": ("exact", "hand x from layer to layer in SBUF instead of HBM"),
    "VLLM_NEURON_MEGA_MOE_SBUF_COLLECTIVE": ("exact", "run the MoE collectives on SBUF buffers"),
    "VLLM_NEURON_MEGA_SBUF_ATTN_RS": ("exact", "keep the attention output in SBUF for an SBUF TP reduce-scatter"),
    "VLLM_NEURON_MEGA_SBUF_ATTN_AG": ("exact", "gather the attention input along the free axis in SBUF"),
    "VLLM_NEURON_MEGA_SBUF_RESID1": ("exact", "keep the first residual add's result in SBUF (with PREQUANT_MOE)"),
    "VLLM_NEURON_MEGA_HOIST_MASK": ("exact", "build the full and sliding attention masks once before the layers"),
    "VLLM_NEURON_MEGA_DOWN_PREFETCH": ("exact", "prefetch the expert down weight into SBUF before attention"),
    "VLLM_NEURON_MEGA_DISABLE_FA": ("exact", "one banded softmax over s_prior instead of flash-attention tiling"),
    "VLLM_NEURON_MEGA_COLLECTIVE_PRIVATE_SRC": ("exact", "collective operands in private HBM (set to 0: shared)"),
    "VLLM_NEURON_MEGA_GU_P0": ("exact", "DMA priority 0 for the gate/up weight load"),
    "VLLM_NEURON_MEGA_GU_P1": ("exact", "DMA priority 1 for the gate/up weight load"),
    "VLLM_NEURON_MEGA_GU_P2": ("exact", "DMA priority 2 for the gate/up weight load"),
    "VLLM_NEURON_MEGA_GATE_P2": ("exact", "DMA priority 2 for every layer's gate prefetch"),
    "VLLM_NEURON_MEGA_GATE_P2_SWA": ("exact", "DMA priority 2 for the sliding layers' gate prefetch"),
    "VLLM_NEURON_MEGA_GU_DMA_ENGINE": ("exact", "'swdge' puts the gate/up load on the software DGE queue"),
    "VLLM_NEURON_MEGA_SCALE_1TRIG": ("exact", "load the gate/up MX scales in 4 DMAs instead of 4 per I tile"),
    "VLLM_NEURON_MEGA_MOE_SWDGE": ("exact", "the MoE weight loads on the software DGE queue"),
    "VLLM_NEURON_MEGA_UPDOWN_P0": ("exact", "DMA priority 0 for the up half and the down weight loads"),
}


@dataclass(frozen=True)
class Setting:
    name: str
    value: str
    read: str  # default_on | truthy | value
    default: str | None  # the source's default for a value read
    origin: str  # gkbuild | recipe
    numerics: str  # required | exact | lossy | layout | unknown
    effect: str
    sites: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"value": self.value, "read": self.read, "origin": self.origin, "numerics": self.numerics,
                "effect": self.effect, "sites": list(self.sites)}


def reference(read: str, default: str | None, name: str) -> str:
    """The value that keeps the kernel on its reference path (KV write-back on)."""
    if name == KV_UPDATE:
        return "1"
    if read == "default_on":
        return "0"
    if read == "truthy":
        return ""
    return default if default is not None else ""


def _on(read: str, value: str, default: str | None, off: list[str]) -> bool:
    """Whether ``value`` takes the switch's non-default path, as the source reads it."""
    if read == "default_on":
        return value not in off
    if read == "truthy":
        return value != ""
    return value != (default or "")


def _merge(reads: list[dict]) -> dict[str, dict]:
    """One entry a switch name over all its read sites. A name read two ways keeps the strictest
    reading (default_on, then truthy, then value)."""
    rank = {"default_on": 0, "truthy": 1, "value": 2}
    out: dict[str, dict] = {}
    for r in reads:
        cur = out.setdefault(r["name"], {"read": r["read"], "default": r["default"], "sites": []})
        if rank[r["read"]] < rank[cur["read"]]:
            cur["read"], cur["default"] = r["read"], r["default"]
        cur["sites"].append(r["site"])
    return out


def overrides(recipe_switches: list[str]) -> dict[str, str]:
    return dict(sw.partition("=")[::2] for sw in recipe_switches)


def settings(reads: list[dict], off_values: list[str] | None, asked: dict[str, str], where: str,
             partial: bool = False) -> list[Setting]:
    """Every switch ``reads`` names, each with its explicit value: the recipe's (``asked``) or the
    reference path's. Refuses, in one line, a read whose form gkbuild cannot tell, a switch the
    revision does not read, the KV write-back turned off, and a layout switch turned on.
    ``partial``: ``reads`` cover only some of the library's files (a committed interface, before
    the checkout is scanned): a recipe switch they do not name is kept, to be judged by the scan."""
    odd = [r for r in reads if r["read"] == "unrecognized"]
    if odd:
        raise GkError(f"{where}: {odd[0]['site']}: {odd[0]['name']} is read as `{odd[0]['expr']}`, a form gkbuild cannot "
                      f"tell; every switch is set explicitly, and this one cannot be")
    off = off_values or DEFAULT_OFF
    merged = _merge(reads)
    unknown = sorted(set(asked) - set(merged))
    if unknown and not partial:
        raise GkError(f"{where}: compile.kernel_switches: {unknown} are not read by this kernel revision "
                      f"(it reads {sorted(merged) or 'none'})")
    out = [Setting(n, asked[n], "unknown", None, "recipe", CATALOGUE.get(n, ("unknown", ""))[0],
                   CATALOGUE.get(n, ("", "not read by the files of gkbuild's interface; judged when the checkout is "
                                     "scanned"))[1], ()) for n in unknown]
    for name, r in sorted(merged.items()):
        numerics, effect = CATALOGUE.get(name, ("unknown", "not in gkbuild's catalogue: kept on the reference path "
                                                           "unless the recipe sets it"))
        ref = reference(r["read"], r["default"], name)
        value = asked.get(name, ref)
        s = Setting(name, value, r["read"], r["default"], "recipe" if name in asked else "gkbuild", numerics,
                    effect, tuple(r["sites"]))
        active = _on(r["read"], value, r["default"], off)
        if name == KV_UPDATE and not active:
            how = f"off for {off}" if r["read"] == "default_on" else "on for any non-empty value"
            raise GkError(f"{where}: compile.kernel_switches: {name}={value!r} turns the KV write-back off (this "
                          f"revision reads it {how}); the decode step must write its token's K/V")
        if numerics == "layout" and active:
            raise GkError(f"{where}: compile.kernel_switches: {name}={value} {effect}; the build's shards would be "
                          f"read wrongly")
        out.append(s)
    return out


def switch_table() -> dict[str, list[dict]]:
    """For each revision with a committed interface: its switches as gkbuild sets them by default."""
    from .interface import committed

    out = {}
    for doc in committed():
        out[f"{doc['repo']}@{doc['commit'][:8]}"] = [
            {"name": s.name, "read": s.read, "default": s.default, "value": s.value, "numerics": s.numerics,
             "effect": s.effect, "sites": list(s.sites)}
            for s in settings(doc["switches"], doc["flag_off_values"], {}, "recipe-doc")]
    return out


def environment(settings_: list[Setting]) -> dict[str, str]:
    return {s.name: s.value for s in settings_}


def lossy_on(kernel: dict) -> list[str]:
    """``NAME=VALUE`` of the switches a program's kernel record (manifest ``kernel``) was set to by
    the recipe that change numerics the twins do not model (or whose effect gkbuild does not know)."""
    if kernel.get("switches"):
        return [f"{n}={s['value']}" for n, s in sorted(kernel["switches"].items())
                if s.get("numerics") in ("lossy", "unknown") and s.get("origin") == "recipe"]
    return [f"{n}={v}" for n, v in sorted((kernel.get("switch_overrides") or {}).items())
            if CATALOGUE.get(n, ("unknown",))[0] in ("lossy", "unknown")]
