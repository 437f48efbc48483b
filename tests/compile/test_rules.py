"""The compiler's documented rules applied before anything is traced: the support matrix, the plan's
verdict, and the scan of a kernel checkout for the FP8 types its reachable code declares."""

import json
import os

import pytest

from gkbuild import recipe
from gkbuild.compile import neuron, rules, signature
from gkbuild.model import preset
from gkbuild.plan import make_plan
from tests.conftest import RECIPES, run_cli


def _cell(rows, **want):
    return next(r for r in rows if all(r[k] == v for k, v in want.items()))


def test_the_matrix_follows_the_documented_rules():
    rows = rules.matrix()
    assert len(rows) == 2 * 3 * 2 * 2
    for r in rows:  # trn2 cannot run the MX MoE at all
        if r["target"] == "trn2" and r["experts"] == "mxfp4":
            assert (r["status"], r["rule"]) == ("refused", "nc_matmul_mx") and "NeuronCore-v3" in r["line"]
        if r["experts"] == "bf16":  # the published decode requires the MX scales
            assert (r["status"], r["rule"]) == ("refused", "interface") and "expert_gate_up_weights_scale" in r["line"]
    # EOCP001 where both flavours meet: packed K (legacy e4m3) next to e4m3fn K/V and the MX MoE, on trn3
    for form in ("stacked", "paired"):
        packed = _cell(rows, target="trn3", kv="fp8 packed", form=form, experts="mxfp4")
        assert (packed["status"], packed["rule"], packed["doctor"]) == ("unknown", "NCC_EOCP001", "e4m3_mixing")
        assert "_k_update_fp8_packed" in packed["line"] and "argument K_cache" in packed["line"]
        plain = _cell(rows, target="trn3", kv="fp8", form=form, experts="mxfp4")
        assert (plain["rule"], plain["doctor"]) == ("moe_mx_dtype", "mx_carrier")  # no legacy e4m3: only the carrier
    # EVRF051: the conversion flag is present on trn2 FP8, absent on bf16 and on trn3
    for r in rows:
        fp8_trn2 = r["target"] == "trn2" and r["kv"] != "bf16"
        assert (neuron.FP8_ON_TRN2 in r["flags"]) == fp8_trn2, r
        if fp8_trn2 and r["experts"] == "mxfp4":
            assert any(n.startswith("NCC_EVRF051: --experimental-unsafe") for n in r["notes"])
            assert any("never converts QuantizeMX" in n for n in r["notes"])
    # a host profile that answered the items turns unknowns into verdicts
    rows = rules.matrix({"mx_carrier": "uint16", "e4m3_mixing": "refused"})
    assert _cell(rows, target="trn3", kv="fp8", form="stacked", experts="mxfp4")["status"] == "compiles"
    assert _cell(rows, target="trn3", kv="fp8 packed", form="paired", experts="mxfp4")["rule"] == "NCC_EOCP001"
    assert _cell(rows, target="trn3", kv="fp8 packed", form="paired", experts="mxfp4")["status"] == "refused"
    rows = rules.matrix({"mx_carrier": "uint16", "e4m3_mixing": "accepted"})
    assert _cell(rows, target="trn3", kv="fp8 packed", form="paired", experts="mxfp4")["status"] == "compiles"


def _decode(sets):
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml", sets)
    p = make_plan(r, preset("tiny-topology"))
    return r, signature.neuron_decode(p, 128)


def test_each_rule_refuses_what_its_source_says(monkeypatch):
    r, sig = _decode(["target=trn2", "kv_cache.packed=false"])
    own = [rules.Decl("float8_e4m3", "k.py:3", None)]  # a trn2 kernel of one's own: no MX MoE
    v = rules.verdict(r, sig, [], own)
    assert (v.status, v.rule) == ("refused", "NCC_EVRF051") and "without --experimental" in v.line
    assert rules.verdict(r, sig, [neuron.FP8_ON_TRN2], own).status == "compiles"
    r3, sig3 = _decode(["target=trn3", "kv_cache.packed=false"])
    assert rules.verdict(r3, sig3, [], own).rule == "NCC_EOCP001"  # e4m3fn K/V next to the kernel's e4m3
    monkeypatch.setitem(rules.NEURONCORE, "trn3", 5)  # hardware newer than Trn3 refuses legacy e4m3
    v = rules.verdict(r3, sig3, [], own)
    assert (v.status, v.rule) == ("refused", "NCC_EVRF052") and "k.py:3" in v.line


def test_plan_states_the_verdict_and_refuses_in_one_line():
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn3.yaml"))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("verdict decode-b128"))
    assert "NCC_EOCP001" in line and "e4m3_mixing" in line and "_k_update_fp8_packed" in line
    j = json.loads(run_cli("plan", str(RECIPES / "gpt-oss-120b-trn3.yaml"), "--json").stdout)
    assert [v["rule"] for v in j["verdicts"]] == ["NCC_EOCP001", None]
    r = run_cli("plan", str(RECIPES / "gpt-oss-120b-trn3.yaml"), "--set", "target=trn2")
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("gkbuild: error")]
    assert r.returncode == 1 and len(err) == 1 and "refused by nc_matmul_mx" in err[0]
    assert err[0].endswith(rules.TRN3_OR_OWN_KERNEL)  # and what to do instead


def test_recipe_doc_prints_the_matrix_citing_each_rule():
    r = run_cli("recipe-doc", "--matrix")
    assert r.returncode == 0, r.stderr
    for rule in ("nc_matmul_mx", "NCC_EVRF051", "NCC_EVRF052", "NCC_EOCP001"):
        assert f"{rule}: " in r.stdout and rules.RULES[rule].source in r.stdout
    j = json.loads(run_cli("recipe-doc", "--matrix", "--json").stdout)
    assert len(j["matrix"]) == 24 and set(j["rules"]) >= {"nc_matmul_mx", "NCC_EOCP001"}


def test_the_scan_follows_imports_from_the_entry_and_names_each_site(tmp_path):
    pkg = tmp_path / "lib" / "src" / "nkilib_src" / "nkilib" / "k"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "entry.py").write_text("import nki.language as nl\nfrom .sub.att import upd\nfrom . import moe\n"
                                  "X = nl.ndarray((1,), dtype=nl.float8_e4m3fn)\n")
    (pkg / "sub" / "att.py").write_text("import nki.language as nl\n\n\ndef _k_update_fp8_packed(v):\n"
                                        "    return v.reinterpret_cast(nl.float8_e4m3)\n\n\ndef upd():\n    pass\n")
    (pkg / "moe.py").write_text("import nki.language as nl\nSIZES = {nl.float8_e4m3: 1}  # a mention, not a tensor\n"
                                "MX = (nl.float4_e2m1fn_x4,)\n\n\ndef parse_moe_block_config(d):\n"
                                "    return d in MX, nl.ndarray((1,), dtype=nl.float8_e4m3fn_x4)\n")
    (pkg / "unreached.py").write_text("import nki.language as nl\nY = nl.ndarray((1,), dtype=nl.float8_e4m3)\n")
    got = {(d.type, d.site, d.function) for d in rules.declarations(tmp_path / "lib", "nkilib.k.entry:f")}
    root = "src/nkilib_src/nkilib/k"
    assert got == {("float8_e4m3fn", f"{root}/entry.py:4", None),
                   ("float8_e4m3", f"{root}/sub/att.py:5", "_k_update_fp8_packed"),
                   ("float8_e4m3fn_x4", f"{root}/moe.py:7", "parse_moe_block_config")}
    facts = {"packed": False, "mx": True}
    assert [d.type for d in rules.declarations(tmp_path / "lib", "nkilib.k.entry:f") if d.applies(facts)] == [
        "float8_e4m3fn", "float8_e4m3fn_x4"]


@pytest.mark.parametrize("library", ["A", "F"])
def test_the_stand_ins_declare_what_the_published_sources_do(library):
    """The scan of each stand-in tree finds the published revision's committed declarations (type and
    function), at a file:line of the tree."""
    from tests.compile.conftest import LIB_A, LIB_F

    lib = {"A": LIB_A, "F": LIB_F}[library]
    got = {(d.type, d.function) for d in rules.declarations(lib, neuron.kernel_source.ENTRIES["decode"])}
    want = {(t, site.split(":")[1]) for t, site in rules.PUBLISHED["aws-neuron/nki-library"]}
    assert want <= got, want - got


def _library_case(tmp_path, case: str):
    """A copy of the stand-in decode library, spoiled as ``case`` says; the --set that points at it."""
    import shutil

    from tests.compile.conftest import LIB_A

    lib = tmp_path / "lib"
    module = "src/nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental/gpt_oss/gpt_oss_decode_layer_dp_tp_ep.py"
    if case.startswith("library"):
        {"library missing": lambda: None, "library a file": lambda: lib.write_text("x"),
         "library a fifo": lambda: os.mkfifo(lib)}[case]()
    else:
        shutil.copytree(LIB_A, lib)
        entry = lib / module
        entry.unlink()
        {"entry missing": lambda: None, "entry a fifo": lambda: os.mkfifo(entry),
         "entry a link to /dev/zero": lambda: entry.symlink_to("/dev/zero"),
         "a 45 MB module nothing imports": lambda: (shutil.copy(LIB_A / module, entry),
                                                    (lib / "src" / "unused.py").write_bytes(b"#" * (45 << 20)))}[case]()
    return f"compile.kernels.decode.library={lib}"


@pytest.mark.parametrize("case", ["library missing", "library a file", "library a fifo", "entry missing",
                                  "entry a fifo", "entry a link to /dev/zero", "a 45 MB module nothing imports"])
def test_plan_never_says_compiles_of_a_library_it_could_not_read(case, tmp_path):
    """plan used to skip what it could not find and judge "compiles", while the compile then failed
    "not importable" (or refused an oversized module): both now say the same one line, rc 1."""
    args = (str(RECIPES / "tiny-topology-trn3.yaml"), "--set", _library_case(tmp_path, case))
    plan = run_cli("plan", *args)
    comp = run_cli("compile", *args, "--out", str(tmp_path / "b"), "-q")
    assert plan.returncode == 1 and plan.stderr.count("\n") == 1 and "compiles" not in plan.stdout, plan.stderr
    assert comp.returncode == 1 and comp.stderr == plan.stderr and not (tmp_path / "b").exists()
