"""The Neuron compiler's documented rules, as data, applied to each program before anything is traced.

Each rule is what AWS documents (an error page or an API docstring), cited with its source. A rule is
applied to one program from two things: the dtypes of the program's arguments (its signature) and the
FP8/MX types the kernel's reachable code declares (``declarations``: a scan of the checkout from the
entry module through its imports, with file:line; for a published revision not checked out yet, the
sites gkbuild read from its published text, ``PUBLISHED``). A verdict is ``compiles``, ``refused``
(the rule, one line) or ``unknown`` (a Neuron host decides it: the ``gkbuild doctor`` item named),
unless a host profile (``hostprofile``) has answered that item.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GkError
from . import interface, kernel_source

NEURONCORE = {"trn1": 2, "trn2": 3, "trn3": 4}  # NeuronCore-v2 / v3 / v4
LEGACY = "float8_e4m3"  # IEEE-style e4m3 (max 240): nl.float8_e4m3
OCP = ("float8_e4m3fn", "float8_e4m3fn_x4")  # OCP e4m3fn (max 448) and its MX x4 form
MX = ("float4_e2m1fn_x4", "float8_e4m3fn_x4")  # what the MoE takes as MX (parse_moe_block_config)
FP8_TYPES = (LEGACY, *OCP, "float4_e2m1fn_x4")
DOCS = "awsdocs-neuron.readthedocs-hosted.com/en/latest"


@dataclass(frozen=True)
class Rule:
    id: str
    says: str
    source: str
    remedy: str = ""  # what a refused recipe can do instead, as its one line ends


TRN3_OR_OWN_KERNEL = ("build for trn3 (target: trn3, as recipes/*-trn3.yaml do), or name a decode kernel whose MoE "
                      "runs on NeuronCore-v3 (compile.kernels.decode.library)")
RULES = {r.id: r for r in (
    Rule("nc_matmul_mx", "nki.isa.nc_matmul_mx is available only on NeuronCore-v4 and newer (Trn3; Trn2 is v3)",
         f"{DOCS}/nki/api/generated/nki.isa.nc_matmul_mx.html", TRN3_OR_OWN_KERNEL),
    Rule("NCC_EVRF051", "F8E4M3FN is not supported on Trn1/Trn2; --experimental-unsafe-fp8e4m3fn-as-fp8e4m3 converts "
                        "F8E4M3FN operands to F8E4M3 for other operations, never for QuantizeMX",
         f"{DOCS}/compiler/error-codes/evrf051.html (neuronx-cc error code NCC_EVRF051)", TRN3_OR_OWN_KERNEL),
    Rule("NCC_EVRF052", "F8E4M3 is refused only on hardware newer than Trn3",
         f"{DOCS}/compiler/error-codes/evrf052.html (neuronx-cc error code NCC_EVRF052)"),
    Rule("NCC_EOCP001", "a compiled module selects one E4M3 conversion mode: one holding both float8_e4m3 and "
                        "float8_e4m3fn tensors is refused (often an NKI kernel declaring scratch tensors of the other "
                        "E4M3 type)", f"{DOCS}/compiler/error-codes/eocp001.html (neuronx-cc error code NCC_EOCP001)",
         "keep one E4M3 type: store the KV unpacked (kv_cache.packed: false) or as bf16 (kv_cache.dtype: bf16)"),
    Rule("moe_mx_dtype", "the MoE takes its experts as MX only when the argument's dtype is float4_e2m1fn_x4 or "
                         "float8_e4m3fn_x4, and at LNC=1 takes MX only; how a torch dtype reaches an nki.jit kernel "
                         "under torch_neuronx.trace is not documented",
         "aws-neuron/nki-library@e9ef98fc moe_block_tkg_utils.py parse_moe_block_config, validate_moe_block_inputs"),
)}

# The FP8/MX types the published decode revisions' reachable code declares, read from their published
# text (not in this repository: sites by function; each interface pins the decode file's sha256): the
# packed-K update writes through ``TensorView(...).reinterpret_cast(nl.float8_e4m3)``; the MoE takes
# its experts as MX when their dtype is in ``_MX_SUPPORTED_DTYPES = (nl.float4_e2m1fn_x4,
# nl.float8_e4m3fn_x4)`` (moe_block_tkg_utils.py, parse_moe_block_config) and quantizes its activations
# into ``nl.ndarray(..., dtype=nl.float8_e4m3fn_x4)``. F calls the same blocks. Decode only: the
# tail's are read from its checkout.
PUBLISHED = {repo: (("float8_e4m3", "attention_block_tkg.py:_k_update_fp8_packed"),
                    ("float4_e2m1fn_x4", "moe_block_tkg_utils.py:parse_moe_block_config"),
                    ("float8_e4m3fn_x4", "moe_block_tkg_utils.py:parse_moe_block_config"))
             for repo in ("aws-neuron/nki-library", "baonudesifeizhai/nki-library")}
# A declaration in one of these functions counts only for the programs that reach it.
WHEN = {"_k_update_fp8_packed": "packed", "parse_moe_block_config": "mx"}  # function -> the fact it needs


@dataclass(frozen=True)
class Decl:
    type: str
    site: str  # file:line (a scan) or file:function (PUBLISHED)
    function: str | None

    def applies(self, facts: dict) -> bool:
        fact = WHEN.get(self.function or "")
        return fact is None or facts[fact]


@dataclass
class Verdict:
    program: str
    status: str = "compiles"  # compiles | refused | unknown
    rule: str | None = None  # the rule that decides a refusal or an unknown
    line: str = ""  # the rule's one line
    doctor: str | None = None  # the doctor item that decides an unknown
    notes: list = field(default_factory=list)  # rules that hold and what they ask (e.g. the EVRF051 flag)
    types: list = field(default_factory=list)  # the FP8/MX types the program holds, with where from

    def to_dict(self) -> dict:
        return {"program": self.program, "status": self.status, "rule": self.rule, "line": self.line,
                "doctor": self.doctor, "notes": self.notes, "types": self.types}

    def short(self) -> str:
        if self.status == "compiles":
            return "compiles" + (f" ({'; '.join(self.notes)})" if self.notes else "")
        if self.status == "unknown":
            return f"unknown until `gkbuild doctor` answers {self.doctor}: {self.rule}: {self.line}"
        return f"refused: {self.rule}: {self.line}"


# -- the kernel checkout's declarations ------------------------------------------------------------------
def _module_file(roots: list[Path], module: str) -> Path | None:
    for r in roots:
        base = r.joinpath(*module.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
    return None


def _imports(tree: ast.Module, module: str, is_pkg: bool) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")[:len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def _declares(node: ast.Attribute, parents: dict) -> bool:
    """``nl.<type>`` given to a call (``nl.ndarray(..., dtype=nl.T)``, ``reinterpret_cast(nl.T)``, or in a
    tuple/list argument): a tensor of that type. A mention elsewhere (a size table's key, a module-level
    tuple a dtype is tested against) declares nothing."""
    up = parents.get(node)
    if isinstance(up, (ast.Tuple, ast.List)):
        up = parents.get(up)
    if isinstance(up, ast.keyword):
        up = parents.get(up)
    return isinstance(up, ast.Call) and up.func is not node


def declarations(root: Path, entry: str) -> list[Decl]:
    """The FP8/MX types a tensor is declared with (``_declares``) in the code reachable from
    ``entry``'s module through imports inside the checkout, each with file:line and its enclosing
    function."""
    roots = [Path(p) for p in kernel_source.import_roots(Path(root))]
    todo, seen, out = [entry.partition(":")[0]], set(), []
    if _module_file(roots, todo[0]) is None:  # nothing read is no verdict: the trace could not import it either
        raise GkError(f"kernel library {root}: the entry {entry}'s module is not a file there (looked under "
                      f"{', '.join(str(r) for r in roots)}); the compile could not import it")
    while todo:
        mod = todo.pop()
        path = _module_file(roots, mod)
        if path is None or path in seen:
            continue
        seen.add(path)
        rel = path.relative_to(root).as_posix()
        tree = interface._tree(interface._text(path), rel)  # noqa: SLF001 - the bounded, one-line-error reader
        todo += _imports(tree, mod, path.name == "__init__.py")
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in FP8_TYPES and _declares(node, parents):
                up = parents.get(node)
                while up is not None and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    up = parents.get(up)
                out.append(Decl(node.attr, f"{rel}:{node.lineno}", up.name if up is not None else None))
    return sorted(set(out), key=lambda d: (d.site.rsplit(":", 1)[0], int(d.site.rsplit(":", 1)[1]), d.type))


def published(library: str, program: str) -> list[Decl] | None:
    """The committed declarations of a published decode revision gkbuild knows, or None."""
    sites = PUBLISHED.get(library.rpartition("@")[0]) if "@" in library and program == "decode" else None
    return None if sites is None else [Decl(t, site, site.split(":", 1)[1]) for t, site in sites]


def kernel_declarations(recipe, program: str = "decode", root: Path | None = None) -> list[Decl] | None:
    """What the program's kernel declares: the scan of ``root`` (a checkout) or of a local library
    folder, else the published revision's committed sites; None when gkbuild cannot know."""
    library, entry = kernel_source.chosen(recipe, program)
    if root is None:
        src = kernel_source.parse(library, recipe.path.parent if recipe.path else None,
                                  f"compile.kernels.{program}.library")
        if src.kind == "path":  # the compile's own checks of a folder, so plan says what the compile will
            root = kernel_source.checkout(src, None)
            interface.scan_switches(root)  # every module read, bounded, as the compile reads them
    return declarations(root, entry) if root is not None else published(library, program)


# -- the verdict -----------------------------------------------------------------------------------------
def verdict(recipe, sig, flags: list[str], decls: list[Decl] | None, profile: dict | None = None) -> Verdict:
    """Apply the rules to one program: its arguments' dtypes, its flags, and its kernel's declarations."""
    from .neuron import FP8_ON_TRN2

    v = Verdict(sig.key)
    facts = {"packed": recipe.kv_cache.dtype == "fp8" and recipe.kv_cache.packed, "mx": recipe.experts == "mxfp4"}
    held = [(i.dtype, f"argument {i.name}") for i in sig.inputs if i.dtype in OCP]
    held += [(d.type, d.site) for d in (decls or []) if d.applies(facts)]
    v.types = [f"{t} ({where})" for t, where in held]
    nc = NEURONCORE.get(recipe.target, 0)
    refusals = []  # (rule, line), in the order they are reported
    if sig.program == "decode" and facts["mx"] and any(t in MX for t, _ in held) and nc < 4:
        refusals.append(("nc_matmul_mx", f"the MX MoE ({_where(held, MX)}) multiplies with nc_matmul_mx; "
                                         f"{recipe.target} is NeuronCore-v{nc}"))
    flavours = {LEGACY if t == LEGACY else "e4m3fn" for t, _ in held if t == LEGACY or t in OCP}
    if nc <= 3 and any(t == "float8_e4m3fn" for t, w in held if w.startswith("argument")):
        if FP8_ON_TRN2 not in flags:
            refusals.append(("NCC_EVRF051", f"float8_e4m3fn operands on {recipe.target} without {FP8_ON_TRN2}"))
        else:
            v.notes.append(f"NCC_EVRF051: {FP8_ON_TRN2} given: the float8_e4m3fn operands compile as float8_e4m3")
        if any(t == "float8_e4m3fn_x4" for t, _ in held):
            refusals.append(("NCC_EVRF051", f"the flag never converts QuantizeMX's float8_e4m3fn_x4 "
                                            f"({_where(held, ('float8_e4m3fn_x4',))})"))
        flavours = {LEGACY} if flavours else flavours
    if LEGACY in flavours and nc > 4:
        refusals.append(("NCC_EVRF052", f"float8_e4m3 ({_where(held, (LEGACY,))}) on NeuronCore-v{nc}"))
    elif LEGACY in flavours:
        v.notes.append(f"NCC_EVRF052: float8_e4m3 is accepted on {recipe.target} (refused only after Trn3)")
    if refusals:
        v.notes += [f"also {rule}: {line}" for rule, line in refusals[1:]]
        return _set(v, "refused", *refusals[0])
    unknown = []  # (rule, line, doctor item) a host decides
    if flavours == {LEGACY, "e4m3fn"}:
        line = (f"float8_e4m3 ({_where(held, (LEGACY,))}) and OCP e4m3fn ({_where(held, OCP)}) in one "
                f"{recipe.target} module")
        mixing = (profile or {}).get("e4m3_mixing")
        if mixing == "refused":
            return _set(v, "refused", "NCC_EOCP001", line + " (refused on this host: doctor e4m3_mixing)")
        if mixing == "accepted":
            v.notes.append("NCC_EOCP001: both E4M3 flavours, accepted on this host (doctor e4m3_mixing)")
        else:
            unknown.append(("NCC_EOCP001", line, "e4m3_mixing"))
    if sig.program == "decode" and facts["mx"] and any(t in MX for t, _ in held):
        carrier = (profile or {}).get("mx_carrier")
        if carrier:
            v.notes.append(f"moe_mx_dtype: the experts travel as {carrier} (doctor mx_carrier)")
        else:
            unknown.append(("moe_mx_dtype", "the MX experts travel as uint16, which the MoE takes as MX only if the "
                                            "SDK presents it as float4_e2m1fn_x4", "mx_carrier"))
    if unknown:
        v.notes += [f"also unknown until doctor answers {d}: {rule}: {line}" for rule, line, d in unknown[1:]]
        return _set(v, "unknown", *unknown[0])
    if decls is None and sig.program == "decode":
        v.notes.append("the kernel's declarations are read from the checkout at compile time")
    return v


def _where(held, types) -> str:
    return ", ".join(dict.fromkeys(w for t, w in held if t in types))


def _set(v: Verdict, status: str, rule: str, line: str, doctor: str | None = None) -> Verdict:
    v.status, v.rule, v.line, v.doctor = status, rule, line, doctor
    return v


def plan_verdicts(plan, profile: dict | None = None, roots: dict | None = None) -> list[Verdict]:
    """Every Neuron program of a plan, judged (``roots``: program -> checkout, when there is one)."""
    from . import neuron, signature

    r = plan.recipe
    decls = {p: kernel_declarations(r, p, (roots or {}).get(p)) for p in ("decode", "tail")}
    return [verdict(r, s, neuron.flags(r, s.program), decls[s.program], profile) for s in signature.programs(plan)]


def refusal(verdicts: list[Verdict]) -> str | None:
    """The first refusal's one line (what to do instead at its end), or None."""
    v = next((v for v in verdicts if v.status == "refused"), None)
    if v is None:
        return None
    rule = RULES[v.rule]
    return (f"the {v.program} program is refused by {v.rule}: {v.line} ({rule.source})"
            + (f"; {rule.remedy}" if rule.remedy else ""))


# -- the support matrix ----------------------------------------------------------------------------------
KV_FORMS = {"bf16": ["kv_cache.dtype=bf16", "kv_cache.packed=false"],
            "fp8": ["kv_cache.dtype=fp8", "kv_cache.packed=false"],
            "fp8 packed": ["kv_cache.dtype=fp8", "kv_cache.packed=true"]}


# The tiny-topology model at the production topology: every program of the real shapes' kinds, in seconds.
MATRIX_RECIPE = {"source": "synth://tiny-topology?layers=2&seed=0", "topology": {"tp": 8, "dp": 16, "ep": 128, "lnc": 1,
                 "vtp": 128, "hops": [8, 16]}, "kv_cache": {"block_size": 4, "num_blocks": 80},
                 "decode": {"batch_sizes": [128], "max_context": 64}, "tail": {"k": 256}}


def matrix(profile: dict | None = None) -> list[dict]:
    """target x KV dtype/packing x form x experts for the published kernels (the defaults each recipe
    picks), judged on the tiny-topology model's programs: what the rules say before any trace."""
    import copy

    from .. import recipe as rc
    from ..model import preset
    from ..plan import make_plan
    from .neuron import flags

    rows = []
    for target in ("trn2", "trn3"):
        for kv, kv_sets in KV_FORMS.items():
            for form in ("stacked", "paired"):
                for experts in ("mxfp4", "bf16"):
                    sets = [f"target={target}", *kv_sets, f"kv_cache.form={form}", f"experts={experts}"]
                    row = {"target": target, "kv": kv, "form": form, "experts": experts}
                    r = rc.from_dict(rc.apply_overrides(copy.deepcopy(MATRIX_RECIPE), sets, "matrix"), "matrix")
                    try:
                        p = make_plan(r, preset("tiny-topology"))
                    except GkError as e:  # the published interface refuses the argument set
                        rows.append({**row, "status": "refused", "rule": "interface", "line": str(e).split(": ", 1)[-1],
                                     "doctor": None, "notes": [], "flags": flags(r)})
                        continue
                    v = next(x for x in plan_verdicts(p, profile) if x.program.startswith("decode"))
                    rows.append({**row, **{k: v.to_dict()[k] for k in ("status", "rule", "line", "doctor", "notes")},
                                 "flags": flags(r)})
    return rows
