"""``gkbuild doctor``: on a Neuron host, answer what the published sources cannot, with probe kernels
of its own (``probes``) compiled through the same ``torch_neuronx.trace`` call a build makes, on the
device when one is present, else trace-only (and it says which).

It prints the SDK's versions, the instance and NeuronCore, whether a device is present, and each
item: its answer, the evidence (compiler message, observed values) and what gkbuild does because of
it. ``--report DIR`` writes ``doctor.json`` (the host profile ``compile --host-profile`` follows,
``hostprofile``) and a self-contained ``doctor.html``.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from ..errors import GkError
from . import hostprofile, neuron, rules
from .probes import SATURATION_VALUES

ITEMS = {  # item -> the question it answers
    "mx_carrier": "Which torch dtype reaches an nki.jit kernel as MX (float4_e2m1fn_x4 tiles, float8_e8m0 scales)? "
                  "The MoE decides 'MX or not' from the argument's dtype and takes MX only at LNC=1",
    "e4m3_mixing": "Does a module holding a legacy float8_e4m3 tensor of the kernel's own next to float8_e4m3fn "
                   "compile (NCC_EOCP001)? Packed FP8 K writes through reinterpret_cast(nl.float8_e4m3)",
    "kv_aliases": "Must the decode's in-place K/V outputs be declared in input_output_aliases for the update to "
                  "persist?",
    "neff_location": "Where does torch_neuronx.trace(cpu_backend=True) leave the NEFF of a kernel called by keyword?",
    "fp8_saturation": "How does the device convert values between 240 and 448 into e4m3 (packed K), and does "
                      "NEURON_RT_ENABLE_OCP_SATURATION change it?",
    "switches": "Does the real checkout read only switches `gkbuild recipe-doc` and gkbuild's catalogue know?",
}
VERSIONS = ("torch-neuronx", "neuronx-cc", "nki", "torch-xla", "torch")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _instance() -> str:
    p = Path("/sys/devices/virtual/dmi/id/product_name")
    try:
        return p.read_text()[:100].strip() or "unknown"
    except OSError:
        return "unknown (no DMI product name)"


def _probe(target: str, work: Path, env_extra: dict, only: str | None = None) -> dict:
    args = neuron.base_flags(target, 1)
    spec = {"workdir": str(work / "probes"), "out": str(work / "out.json"), "compiler_args": args, "only": only,
            "mixing_args": args + ([neuron.FP8_ON_TRN2] if target == "trn2" else [])}
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in neuron.UNSET}
    env.update(NEURON_PLATFORM_TARGET_OVERRIDE=target, **env_extra)
    done = subprocess.run([sys.executable, "-m", "gkbuild.compile.probes", str(work / "spec.json")], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise GkError(f"gkbuild doctor: the probe process failed: {last[0]}")
    from ..jsonio import read

    return read(work / "out.json", 1 << 20)


def _item(id_: str, answer, shown: str, evidence: str, action: str) -> dict:
    return {"id": id_, "question": ITEMS[id_], "answer": answer, "shown": shown, "evidence": evidence,
            "action": action}


def _mx(res: dict) -> tuple[list[dict], dict]:
    seen, err = res["dtypes"]["seen"], res["dtypes"]["error"]
    if err:
        return [_item("mx_carrier", None, "unknown", err, "gkbuild keeps uint16 tiles and uint8 scales (unchecked)")], \
            {"mx_carrier": None, "mx_scale_carrier": None}
    tiles = next((c for c in ("uint16", "float4_e2m1fn_x2") if seen[c].endswith("float4_e2m1fn_x4")), None)
    scales = next((c for c in ("uint8", "float8_e8m0fnu") if seen[c].endswith("float8_e8m0")), None)
    evidence = "; ".join(f"torch.{k} arrives as {v}" for k, v in seen.items())
    if tiles and scales:
        action = (f"the decode passes the expert tiles as torch.{tiles} and their scales as torch.{scales} "
                  f"(views of the shards' uint16 / uint8 bytes)")
    else:
        action = "no torch dtype reaches the kernel as MX here: the MoE refuses every MXFP4 build (moe_mx_dtype)"
    shown = f"tiles as {tiles or 'none'}, scales as {scales or 'none'}"
    return [_item("mx_carrier", tiles and scales and {"tiles": tiles, "scales": scales}, shown, evidence, action)], \
        {"mx_carrier": tiles if scales else None, "mx_scale_carrier": scales if tiles else None}


def _mixing(res: dict) -> tuple[dict, str | None]:
    m = res["mixing"]
    if m["compiled"]:
        return _item("e4m3_mixing", "accepted", "accepted", "the mixed module compiled",
                     "packed FP8 K next to the MX MoE is built (NCC_EOCP001 does not apply here)"), "accepted"
    if "NCC_EOCP001" in (m["error"] or ""):
        return _item("e4m3_mixing", "refused", "refused", m["error"],
                     "plan and compile refuse packed FP8 K next to e4m3fn (NCC_EOCP001); kv_cache.packed: false "
                     "avoids it"), "refused"
    return (_item("e4m3_mixing", None, "unknown", m["error"], "unchecked: the build tries and the compiler decides"),
            None)


def _aliases(res: dict, device: bool) -> tuple[dict, str | None]:
    u, d = res["aliases"]["undeclared"], res["aliases"]["declared"]
    ev = (f"without aliases: {'compiled' if u['compiled'] else u['error']}"
          + (f", {u['after_two_runs']} after two runs" if u["after_two_runs"] is not None else "")
          + f"; with aliases: {'compiled' if d['compiled'] else d['error']}"
          + (f", {d['after_two_runs']} after two runs" if d["after_two_runs"] is not None else ""))
    if not u["compiled"] and "input_output_aliases" in (u["error"] or ""):
        answer = "required"
    elif device and u["after_two_runs"] == 2.0:
        answer = "not required"
    elif device and d["after_two_runs"] == 2.0:
        answer = "required"
    else:
        return _item("kv_aliases", None, "unknown" + ("" if device else " (trace-only: persistence needs a device)"),
                     ev, "unchecked: the decode passes no aliases, as before"), None
    action = ("the decode declares its K/V outputs in input_output_aliases" if answer == "required" else
              "the decode's K/V are updated in place without aliases")
    return _item("kv_aliases", answer, answer, ev, action), answer


def _neff(res: dict) -> tuple[dict, str | None]:
    neffs = res.get("neffs") or []
    if not neffs:
        return _item("neff_location", None, "none found", res["dtypes"]["error"] or "no .neff in compiler_workdir",
                     "unchecked: a build takes the one .neff anywhere in the work folder"), None
    pick = min(neffs, key=lambda p: (p.count("/"), p))
    return _item("neff_location", pick, f"compiler_workdir/{pick}", f"{len(neffs)} NEFF(s): {', '.join(neffs)}",
                 f"a build takes compiler_workdir/{pick}" + (" and ignores the other copies" if len(neffs) > 1 else "")
                 ), pick


def _saturation(plain: dict | None, env: dict | None) -> tuple[dict, str | None]:
    if plain is None:
        return _item("fp8_saturation", None, "unknown (trace-only: needs a device)", "no device to run on",
                     "unchecked: the twin saturates packed K at 240, as the published update's e4m3 view "
                     "suggests"), None

    def saturates(vals):
        return vals is not None and all(isinstance(v, float) and abs(v) <= 240 for v in vals)

    ev = f"{plain['values'] or plain['error']}; with NEURON_RT_ENABLE_OCP_SATURATION=1: {env['values'] or env['error']}"
    ev = f"{SATURATION_VALUES} -> {ev}"
    if saturates(plain["values"]):
        return _item("fp8_saturation", "saturate", "saturates at 240", ev, "packed K beyond 240 saturates as the twin "
                     "models"), "saturate"
    if saturates(env["values"]):
        a = "with NEURON_RT_ENABLE_OCP_SATURATION=1"
        return _item("fp8_saturation", a, "saturates only " + a, ev,
                     "the manifest asks the runtime to set NEURON_RT_ENABLE_OCP_SATURATION=1"), a
    return _item("fp8_saturation", "inf", "overflows to inf", ev,
                 "packed K beyond 240 becomes inf on this device: a packed-FP8 build warns to keep |K| * k_scale "
                 "within 240"), "inf"


def _switches(recipe_path: Path | None) -> dict:
    if recipe_path is None:
        return _item("switches", None, "not checked", "give --kernels RECIPE",
                     "every switch the checkout reads is set explicitly at compile time, as always")
    from ..checkpoint.source import cache_root
    from ..recipe import load
    from .interface import committed
    from .switches import CATALOGUE

    r = load(recipe_path)
    known = {s["name"] for doc in committed() for s in doc["switches"]} | set(CATALOGUE)
    lines, extra, fp8 = [], set(), []
    for program in ("decode", "tail"):
        rec = neuron.kernel(r, program)
        root, done = neuron.prepare(r, program, rec, cache_root())
        names = set(done["switches"] or {})
        extra |= names - known
        lines.append(f"{program} ({rec['library']}): {len(names)} switches")
        fp8 += [f"{d.type} {d.site}" for d in rules.declarations(root, rec["entry"])]
    answer = "matches recipe-doc" if not extra else f"reads {len(extra)} switch(es) gkbuild does not know"
    unknown = [f"unknown to recipe-doc and gkbuild's catalogue: {', '.join(sorted(extra))}"] if extra else []
    ev = "; ".join(lines + unknown
                   + ([f"FP8 types declared: {', '.join(fp8)}"] if fp8 else []))
    return _item("switches", answer, answer, ev, "every switch is set explicitly; one recipe-doc does not list is kept "
                                                 "on the reference path and shown as numerics 'unknown'")


def run(target: str, kernels: Path | None = None, quiet: bool = False, report: Path | None = None) -> dict:
    """The doctor report: the host, every item, and the profile (``report``: the folder it will be
    written to, checked first)."""
    from ..progress import note

    why = neuron.sdk()
    if why:
        raise GkError(f"gkbuild doctor: {why}; run it on a Trainium host (pip install 'gkbuild[neuron]')")
    if report is not None:
        report_folder(report)
    with tempfile.TemporaryDirectory(prefix="gkbuild-doctor-") as tmp:
        note(f"doctor: compiling the probe kernels for {target} (each a neuronx-cc compile)", quiet)
        res = _probe(target, Path(tmp) / "a", {})
        device = res["device"]["present"]
        if device:
            note("doctor: a NeuronCore is present; running the saturation probe with NEURON_RT_ENABLE_OCP_SATURATION=1",
                 quiet)
        env = _probe(target, Path(tmp) / "b", {"NEURON_RT_ENABLE_OCP_SATURATION": "1"}, "saturation") if device else {}
    if kernels is not None:
        note(f"doctor: checking out and scanning {kernels}'s kernel libraries", quiet)
    items, profile = _mx(res)
    for fn in (lambda: _mixing(res), lambda: _aliases(res, device), lambda: _neff(res),
               lambda: _saturation(res.get("saturation"), env.get("saturation"))):
        item, answer = fn()
        items.append(item)
        profile[item["id"]] = answer
    if all(v is None for v in profile.values()):  # not one probe compiled: the SDK is broken, not undecided
        raise GkError(f"gkbuild doctor: no probe compiled, so nothing is answered: {res['dtypes']['error']}; "
                      f"check the Neuron SDK installation")
    items.append(_switches(kernels))
    return {"format": hostprofile.FORMAT, "target": target,
            "sdk": {n: _version(n) for n in VERSIONS}, "instance": _instance(),
            "neuroncore": f"v{rules.NEURONCORE[target]}", "device": res["device"],
            "mode": "device" if device else "trace-only", "items": items, "profile": profile}


def page(rep: dict) -> str:
    """doctor.html: one self-contained page (no scripts, no external resources)."""
    e = html.escape
    rows = "".join(f"<tr id='{e(i['id'])}'><td>{e(i['id'])}</td><td>{e(i['question'])}</td>"
                   f"<td class='answer'>{e(i['shown'])}</td><td>{e(i['evidence'] or '')}</td>"
                   f"<td>{e(i['action'])}</td></tr>" for i in rep["items"])
    sdk = ", ".join(f"{k} {v or 'not installed'}" for k, v in rep["sdk"].items())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>gkbuild doctor ({e(rep['target'])})</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:.4em;"
            "vertical-align:top}table{border-collapse:collapse}</style></head><body>"
            f"<h1>gkbuild doctor: {e(rep['target'])}</h1><p>SDK: {e(sdk)}<br>instance: {e(rep['instance'])}; "
            f"NeuronCore-{e(rep['neuroncore'])}; device: {'present' if rep['device']['present'] else 'absent'} "
            f"({e(rep['mode'])})</p><table><tr><th>item</th><th>question</th><th>answer</th><th>evidence</th>"
            f"<th>what gkbuild does</th></tr>{rows}</table>"
            f"<h2>host profile</h2><pre>{e(json.dumps(rep['profile'], indent=1))}</pre></body></html>\n")


def report_folder(out: Path) -> Path:
    """``--report``'s folder: one that is there, or that can be made (not a file, not a dangling link)."""
    out = Path(out)
    if os.path.islink(out) and not out.exists():
        raise GkError(f"--report {out}: a symlink to {os.readlink(out)}, which does not exist; give a folder")
    if os.path.lexists(out) and not out.is_dir():
        raise GkError(f"--report {out}: not a folder")
    return out


def write(rep: dict, out: Path) -> list[Path]:
    from ..pipeline.state import write_bytes_atomic

    out = report_folder(out)
    write_bytes_atomic(out / "doctor.json", (json.dumps(rep, indent=1) + "\n").encode())
    write_bytes_atomic(out / "doctor.html", page(rep).encode())
    return [out / "doctor.json", out / "doctor.html"]
