"""A host profile: what ``gkbuild doctor`` found on a Neuron host, and the Neuron backend follows
(``compile --host-profile DIR/doctor.json`` or ``compile.host_profile`` in a recipe).

Each answer is one of a few values, or null where doctor could not tell (e.g. trace-only: no
device to run on); a null answer, like a build without a profile, keeps gkbuild's own choice and is
recorded as ``unchecked``. What each program relied on (``relied_on``) goes into its kernel record,
so into its compile key and the manifest, and ``gkbuild inspect`` shows it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import GkError

FORMAT = "gkbuild-doctor-1"
UNCHECKED = "unchecked"
MAX_BYTES = 1 << 20
# answer -> the values it may take (neff_location: a relative path pattern, checked below)
CHOICES = {
    "mx_carrier": ("uint16", "float4_e2m1fn_x2"),
    "mx_scale_carrier": ("uint8", "float8_e8m0fnu"),
    "e4m3_mixing": ("accepted", "refused"),
    "kv_aliases": ("required", "not required"),
    "neff_location": None,
    "fp8_saturation": ("saturate", "inf", "with NEURON_RT_ENABLE_OCP_SATURATION=1"),
}
DEFAULTS = {"mx_carrier": "uint16", "mx_scale_carrier": "uint8", "kv_aliases": "not required",
            "neff_location": None}  # what gkbuild does without an answer (neff_location None: the one .neff anywhere)
# item -> text of a build's failure it explains when the build did not follow an answer to it
SYMPTOMS = {"mx_carrier": ("validate_moe_block_inputs", "MX experts only"), "e4m3_mixing": ("NCC_EOCP001",),
            "kv_aliases": ("input_output_aliases",), "neff_location": ("expected one NEFF",)}
MX_TILES = ("expert_gate_up_weights", "expert_down_weights")
MX_SCALES = ("expert_gate_up_weights_scale", "expert_down_weights_scale")
RUNTIME_ENV = {"with NEURON_RT_ENABLE_OCP_SATURATION=1": {"NEURON_RT_ENABLE_OCP_SATURATION": "1"}}


def _location_ok(v) -> bool:
    return (isinstance(v, str) and 0 < len(v) <= 200 and v.endswith(".neff") and not v.startswith("/")
            and ".." not in v.split("/") and "\\" not in v and v.isprintable())


def load(path: Path, target: str) -> dict:
    """The profile in a doctor.json: ``{"file", "sha256", "target", "answers"}``; one line naming what
    is wrong otherwise."""
    from ..jsonio import read_bounded, loads

    where = f"host profile {path}"
    try:
        raw = read_bounded(Path(path), MAX_BYTES, where)
    except OSError as e:
        raise GkError(f"{where}: {e.strerror or e}") from None
    doc = loads(raw, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise GkError(f"{where}: not a gkbuild doctor report (format {FORMAT!r}); write one with gkbuild doctor")
    if doc.get("target") != target:
        raise GkError(f"{where}: answers for target {doc.get('target')!r}, the build targets {target}; run gkbuild "
                      f"doctor --target {target}")
    answers = doc.get("profile")
    if not isinstance(answers, dict) or set(answers) != set(CHOICES):
        raise GkError(f"{where}: profile: expected exactly the answers {sorted(CHOICES)}")
    for k, v in answers.items():
        ok = v is None or (_location_ok(v) if CHOICES[k] is None else v in CHOICES[k])
        if not ok:
            raise GkError(f"{where}: profile.{k}: {str(v)[:80]!r} is not one of "
                          f"{CHOICES[k] or 'a relative path ending .neff'} (or null)")
    return {"file": str(path), "sha256": hashlib.sha256(raw).hexdigest(), "target": target, "answers": answers}


def of(recipe) -> dict | None:
    """The recipe's profile (``compile.host_profile``, relative to the recipe), or None."""
    p = recipe.compile.host_profile
    if not p:
        return None
    path = Path(p).expanduser()
    if not path.is_absolute() and recipe.path is not None:
        path = recipe.path.parent / path
    return load(path, recipe.target)


def answers(profile: dict | None) -> dict:
    return (profile or {}).get("answers") or {}


def relied_on(recipe, program: str, profile: dict | None) -> dict:
    """The doctor answers one program depends on: the profile's, or ``unchecked``."""
    items = ["neff_location"]
    if program == "decode":
        items += ["kv_aliases"]
        if recipe.experts == "mxfp4":
            items += ["mx_carrier", "mx_scale_carrier"]
        if recipe.kv_cache.dtype == "fp8" and recipe.kv_cache.packed:
            items += ["e4m3_mixing", "fp8_saturation"]
    a = answers(profile)
    return {k: UNCHECKED if a.get(k) is None else a[k] for k in sorted(items)}


def choice(relied: dict, item: str):
    """What the backend does for ``item``: the answer, or gkbuild's default where unchecked."""
    v = relied.get(item, UNCHECKED)
    return DEFAULTS.get(item) if v == UNCHECKED else v


def carrier(name: str, dtype: str, relied: dict) -> str | None:
    """The dtype an input travels as (a view of its stored bytes) where the profile says so, or None."""
    item = "mx_carrier" if name in MX_TILES else "mx_scale_carrier" if name in MX_SCALES else None
    want = choice(relied, item) if item else None
    return want if want and want != dtype else None


def unchecked_hint(message: str, relied: dict) -> str:
    """For a failed trace: the unchecked doctor item that explains it, as one clause (or "")."""
    for item, symptoms in SYMPTOMS.items():
        if relied.get(item) == UNCHECKED and any(s in message for s in symptoms):
            return (f" (doctor item {item} is unchecked for this build: run `gkbuild doctor --report DIR` on the "
                    f"host, then compile with --host-profile DIR/doctor.json)")
    return ""


def record(profile: dict | None) -> dict | str:
    """What the manifest says of the profile the build followed."""
    if profile is None:
        return UNCHECKED
    return {**profile, "runtime_env": RUNTIME_ENV.get(answers(profile).get("fp8_saturation"), {})}
