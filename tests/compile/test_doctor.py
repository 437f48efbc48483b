"""``gkbuild doctor`` against the fake SDK, each item switched both ways (one environment variable a
question, ``fake_sdk/torch_neuronx``), its report parsed from doctor.json and doctor.html."""

import json
import shutil
from html.parser import HTMLParser

import pytest

from gkbuild.compile import doctor, hostprofile
from gkbuild.errors import GkError
from tests.compile.conftest import LIB_A, LIB_F
from tests.conftest import RECIPES, run_cli

OTHER_WAY = {"GK_FAKE_MX_CARRIER": "float4_e2m1fn_x2", "GK_FAKE_MX_SCALE_CARRIER": "float8_e8m0fnu",
             "GK_FAKE_E4M3_MIXING": "refuse", "GK_FAKE_KV_ALIASES": "required", "GK_FAKE_NEFF_LOCATION": "copies",
             "GK_FAKE_FP8_SATURATION": "env"}


class _Rows(HTMLParser):
    """{item id: [cell texts]} of doctor.html's table."""

    def __init__(self):
        super().__init__()
        self.rows, self._row, self._cell = {}, None, None

    def handle_starttag(self, tag, attrs):
        if tag == "tr" and dict(attrs).get("id"):
            self._row = dict(attrs)["id"]
            self.rows[self._row] = []
        elif tag == "td" and self._row:
            self._cell = ""

    def handle_endtag(self, tag):
        if tag == "td" and self._row is not None:
            self.rows[self._row].append(self._cell)
            self._cell = None
        elif tag == "tr":
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _recipe(tmp_path, extra_switch=False):
    """The tiny-topology trn3 recipe on the stand-in libraries (one of them with a switch recipe-doc
    does not list, when asked)."""
    lib = LIB_A
    if extra_switch:
        lib = tmp_path / "libA"
        shutil.copytree(LIB_A, lib)
        (lib / "src/nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental/gpt_oss/_switches.py").open(
            "a").write('\nNEW = bool(os.environ.get("VLLM_NEURON_MEGA_NEW_THING"))\n')
    text = (RECIPES / "tiny-topology-trn3.yaml").read_text().replace("target: trn2", "target: trn3")
    text += f"compile:\n  kernels:\n    decode: {{library: {lib}}}\n    tail: {{library: {LIB_F}}}\n"
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def _doctor(tmp_path, name, env, kernels=None):
    out = tmp_path / name
    args = ["doctor", "--target", "trn3", "--report", str(out)] + (["--kernels", str(kernels)] if kernels else [])
    r = run_cli(*args, env=env)
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "doctor.json").read_text())
    parser = _Rows()
    parser.feed((out / "doctor.html").read_text())
    assert "<script" not in (out / "doctor.html").read_text() and "http" not in (out / "doctor.html").read_text()
    html = {k: {"answer": v[2], "evidence": v[3], "action": v[4]} for k, v in parser.rows.items()}
    assert set(html) == set(doctor.ITEMS) == {i["id"] for i in rep["items"]}
    for i in rep["items"]:  # the page says what the JSON says
        assert html[i["id"]]["answer"] == i["shown"] and html[i["id"]]["action"] == i["action"]
    return rep, html


def test_doctor_without_an_sdk_is_one_line():
    r = run_cli("doctor")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Neuron SDK not installed" in r.stderr


@pytest.mark.slow
def test_doctor_answers_every_item_both_ways(fake_sdk, tmp_path):
    device = {"GK_FAKE_NEURON_DEVICE": "1"}
    rep, html = _doctor(tmp_path, "one", device, _recipe(tmp_path))
    assert rep["mode"] == "device" and rep["device"]["present"] and rep["neuroncore"] == "v4"
    assert rep["profile"] == {"mx_carrier": "uint16", "mx_scale_carrier": "uint8", "e4m3_mixing": "accepted",
                              "kv_aliases": "not required", "neff_location": "graph.neff", "fp8_saturation": "saturate"}
    assert "torch.uint16 arrives as float4_e2m1fn_x4" in html["mx_carrier"]["evidence"]
    assert "2.0 after two runs" in html["kv_aliases"]["evidence"]
    assert html["switches"]["answer"] == "matches recipe-doc"
    assert "float8_e4m3 src/nkilib_src/" in html["switches"]["evidence"]  # the checkout's FP8 declarations
    rep, html = _doctor(tmp_path, "other", {**device, **OTHER_WAY}, _recipe(tmp_path, extra_switch=True))
    assert rep["profile"] == {"mx_carrier": "float4_e2m1fn_x2", "mx_scale_carrier": "float8_e8m0fnu",
                              "e4m3_mixing": "refused", "kv_aliases": "required", "neff_location": "graph.neff",
                              "fp8_saturation": "with NEURON_RT_ENABLE_OCP_SATURATION=1"}
    assert "NCC_EOCP001" in html["e4m3_mixing"]["evidence"] and "refuse packed FP8 K" in html["e4m3_mixing"]["action"]
    assert "2 NEFF(s): cache/graph.neff, graph.neff" in html["neff_location"]["evidence"]
    assert "'inf'" in html["fp8_saturation"]["evidence"]
    assert "VLLM_NEURON_MEGA_NEW_THING" in html["switches"]["evidence"]


def test_without_a_device_doctor_is_trace_only_and_says_so(fake_sdk, tmp_path):
    """What needs a run is left unanswered; what the compiler decides is answered."""
    rep, html = _doctor(tmp_path, "trace", {"GK_FAKE_KV_ALIASES": "required"})
    assert rep["mode"] == "trace-only" and not rep["device"]["present"] and "no Neuron device" in rep["device"]["evidence"]
    assert rep["profile"]["kv_aliases"] == "required"  # the compiler refused the undeclared in-place update
    assert rep["profile"]["fp8_saturation"] is None and "trace-only" in html["fp8_saturation"]["answer"]
    assert html["switches"]["answer"] == "not checked"
    with pytest.raises(GkError, match="answers for target 'trn3', the build targets trn2"):
        hostprofile.load(tmp_path / "trace" / "doctor.json", "trn2")


def test_saturation_is_read_from_the_device_values():
    sat = {"values": [240.0] * 6 + [-240.0], "error": None}
    inf = {"values": [240.0, 240.0, "inf", "inf", "inf", "inf", "-inf"], "error": None}
    assert doctor._saturation(sat, inf)[1] == "saturate"
    assert doctor._saturation(inf, sat)[1] == "with NEURON_RT_ENABLE_OCP_SATURATION=1"
    assert doctor._saturation(inf, inf)[1] == "inf"


@pytest.mark.parametrize("bad, message", [
    ({"format": "x"}, "not a gkbuild doctor report"),
    ({"profile": {"mx_carrier": "int8"}}, r"profile: expected exactly the answers"),
    ({"profile_mx": "int8"}, r"profile.mx_carrier: 'int8' is not one of"),
    ({"profile_loc": "../../etc/x.neff"}, r"profile.neff_location: '../../etc/x.neff' is not one of a relative path"),
])
def test_a_hostile_profile_is_one_line(tmp_path, bad, message):
    good = {"format": hostprofile.FORMAT, "target": "trn3", "profile": {k: None for k in hostprofile.CHOICES}}
    doc = {**good, **{k: v for k, v in bad.items() if k in ("format", "profile")}}
    if "profile_mx" in bad:
        doc["profile"] = {**good["profile"], "mx_carrier": bad["profile_mx"]}
    if "profile_loc" in bad:
        doc["profile"] = {**good["profile"], "neff_location": bad["profile_loc"]}
    (tmp_path / "d.json").write_text(json.dumps(doc))
    with pytest.raises(GkError, match=message) as e:
        hostprofile.load(tmp_path / "d.json", "trn3")
    assert "\n" not in str(e.value)


def _profile(tmp_path, name, **answers):
    """A doctor.json holding ``answers`` (the rest null), as doctor writes it."""
    doc = {"format": hostprofile.FORMAT, "target": "trn3", "items": [],
           "profile": {k: answers.get(k) for k in hostprofile.CHOICES}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


DEFAULT_ANSWERS = {"mx_carrier": "uint16", "mx_scale_carrier": "uint8", "e4m3_mixing": "accepted",
                   "kv_aliases": "not required", "neff_location": "graph.neff", "fp8_saturation": "saturate"}
OTHER_ANSWERS = {"mx_carrier": "float4_e2m1fn_x2", "mx_scale_carrier": "float8_e8m0fnu", "e4m3_mixing": "refused",
                 "kv_aliases": "required", "neff_location": "graph.neff",
                 "fp8_saturation": "with NEURON_RT_ENABLE_OCP_SATURATION=1"}


@pytest.mark.slow
def test_a_build_follows_its_host_profile(fake_sdk, tmp_path, monkeypatch):
    """Each way of the fake: the build with the matching profile passes the matching carrier, aliases
    and NEFF; without a profile it fails in one line naming the doctor item; the profile is in the
    manifest and the compile key; inspect shows what each program relied on."""
    from gkbuild import recipe
    from gkbuild.pipeline.pipeline import compile_build

    def build(out, profile=None, sets=()):
        r = recipe.load(_recipe(tmp_path), list(sets))
        if profile:
            r.compile.host_profile = str(profile)
        return compile_build(r, out=tmp_path / out, quiet=True, require_neff=True)

    def log():
        return [json.loads(line) for line in fake_sdk["sdk"].read_text().splitlines()]

    # the default way: the profile's answers are today's choices; the manifest says what it followed
    plain = build("p", sets=["kv_cache.packed=false"])
    assert plain.manifest["compile"]["host_profile"] == "unchecked"
    assert plain.manifest["compile"]["artifacts"][0]["kernel"]["host_profile"]["mx_carrier"] == "unchecked"
    followed = build("p", _profile(tmp_path, "default", **DEFAULT_ANSWERS), ["kv_cache.packed=false"])
    assert followed.manifest["compile"]["host_profile"]["answers"] == DEFAULT_ANSWERS
    assert followed.manifest["compile"]["cache_keys"] != plain.manifest["compile"]["cache_keys"]
    dec = log()[-2]
    assert dec["aliases"] == [] and "uint16" in dec["dtypes"] and "float4_e2m1fn_x2" not in dec["dtypes"]
    packed = build("k", _profile(tmp_path, "default", **DEFAULT_ANSWERS))  # EOCP001 accepted on this host
    relied = packed.manifest["compile"]["artifacts"][0]["kernel"]["host_profile"]
    assert relied["e4m3_mixing"] == "accepted" and relied["fp8_saturation"] == "saturate"
    # the other way, item by item: no profile fails naming the item, the matching profile builds
    other = _profile(tmp_path, "other", **OTHER_ANSWERS)
    for var, item in (("GK_FAKE_MX_CARRIER", "mx_carrier"), ("GK_FAKE_KV_ALIASES", "kv_aliases"),
                      ("GK_FAKE_NEFF_LOCATION", "neff_location")):
        with monkeypatch.context() as mp:
            mp.setenv(var, OTHER_WAY[var])
            if var == "GK_FAKE_MX_CARRIER":
                mp.setenv("GK_FAKE_MX_SCALE_CARRIER", OTHER_WAY["GK_FAKE_MX_SCALE_CARRIER"])
            with pytest.raises(GkError, match=rf"^decode-b128: .*\(doctor item {item} is unchecked for this build") as e:
                build("p", sets=["kv_cache.packed=false"])
            assert "\n" not in str(e.value)
    for var, value in OTHER_WAY.items():
        monkeypatch.setenv(var, value)
    res = build("p", other, ["kv_cache.packed=false"])
    dec, tail = log()[-2:]
    sig = res.manifest["compile"]["artifacts"][0]
    names = [i["name"] for i in sig["inputs"]]
    assert dec["aliases"] == [[names.index("K_cache"), 1], [names.index("V_cache"), 2]] and tail["aliases"] == []
    assert dec["dtypes"][names.index("expert_gate_up_weights")] == "float4_e2m1fn_x2"
    assert dec["dtypes"][names.index("expert_down_weights_scale")] == "float8_e8m0fnu"
    assert res.manifest["compile"]["host_profile"]["runtime_env"] == {"NEURON_RT_ENABLE_OCP_SATURATION": "1"}
    # packed FP8 K next to the MX MoE on a host that refuses both E4M3 flavours: refused before any trace
    with pytest.raises(GkError, match=r"^trn3: the decode-b128 program is refused by NCC_EOCP001: .*refused on this "
                                      r"host: doctor e4m3_mixing"):
        build("k2", other)
    assert not (tmp_path / "k2" / ".gkbuild" / "neuron").exists()
    progs = {p["name"]: p["doctor"] for p in json.loads(run_cli("inspect", str(tmp_path / "p"), "--json").stdout)["programs"]}
    assert progs == {"decode-b128": {k: OTHER_ANSWERS[k] for k in ("kv_aliases", "mx_carrier", "mx_scale_carrier",
                                                                   "neff_location")},
                     "tail-b128": {"neff_location": "graph.neff"}}
    assert "doctor answers relied on" in run_cli("inspect", str(tmp_path / "p")).stdout


def test_plan_and_compile_read_the_profile_first(tmp_path):
    """The recipe key and --host-profile: plan judges with the profile's answers; a missing profile or
    one for a cpu build is one line before anything is written."""
    recipe = str(RECIPES / "gpt-oss-120b-trn3.yaml")
    other = _profile(tmp_path, "other", **OTHER_ANSWERS)
    r = run_cli("plan", recipe, "--set", f"compile.host_profile={other}")
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("gkbuild: error")]
    assert r.returncode == 1 and len(err) == 1 and "refused by NCC_EOCP001" in err[0], r.stderr
    r = run_cli("plan", recipe, "--json", "--set", f"compile.host_profile={_profile(tmp_path, 'd', **DEFAULT_ANSWERS)}")
    assert [v["status"] for v in json.loads(r.stdout)["verdicts"]] == ["compiles", "compiles"]
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--set", "target=trn3", "--out",
                str(tmp_path / "o"), "-q", "--host-profile", str(tmp_path / "none.json"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "none.json: No such file" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
    r = run_cli("compile", str(RECIPES / "tiny-cpu.yaml"), "--out", str(tmp_path / "o"), "-q", "--host-profile", str(other))
    assert r.returncode == 1 and "is for trn2/trn3 builds, not cpu" in r.stderr and not (tmp_path / "o").exists()


def test_a_report_folder_that_is_a_dangling_link_is_one_line_before_any_probe(fake_sdk, tmp_path):
    (tmp_path / "rep").symlink_to(tmp_path / "nowhere")
    r = run_cli("doctor", "--report", str(tmp_path / "rep"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"--report {tmp_path / 'rep'}: a symlink to {tmp_path / 'nowhere'}, which does not exist" in r.stderr
    assert not (tmp_path / "nowhere").exists() and "compiling the probe" not in r.stderr


@pytest.mark.parametrize("module", ["torch_xla", "neuronxcc"])
def test_an_sdk_that_does_not_import_is_one_line_not_a_report_of_nulls(fake_sdk, tmp_path, monkeypatch, module):
    """find_spec finds the SDK, but one of its modules fails on import (a missing shared library)."""
    sdk = tmp_path / "sdk"
    shutil.copytree(_fake_sdk_dir(), sdk)
    (sdk / module / "__init__.py").write_text('raise ImportError("libnrt.so.1: cannot open shared object file")\n')
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(sdk), *os.environ["PYTHONPATH"].split(os.pathsep)[1:]]))
    r = run_cli("doctor", "--report", str(tmp_path / "rep"))
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("gkbuild: error")]
    assert r.returncode == 1 and len(err) == 1, r.stderr
    assert f"the Neuron SDK does not import ({module}: ImportError: libnrt.so.1" in err[0]
    assert not (tmp_path / "rep").exists()


def test_a_doctor_whose_probes_all_failed_is_one_line(monkeypatch):
    """Every probe's trace failed alike (an SDK broken past its imports): no answer at all is not a report."""
    broken = "torch_neuronx.trace failed: KeyError: 'PJRT_DEVICE'"
    res = {"device": {"present": False, "evidence": broken}, "dtypes": {"seen": {}, "error": broken}, "neffs": [],
           "mixing": {"compiled": False, "error": broken},
           "aliases": {k: {"compiled": False, "error": broken, "after_two_runs": None} for k in ("declared", "undeclared")}}
    monkeypatch.setattr(doctor.neuron, "sdk", lambda: None)
    monkeypatch.setattr(doctor, "_probe", lambda *a, **k: res)
    with pytest.raises(GkError, match=r"^gkbuild doctor: no probe compiled, so nothing is answered: .*KeyError"):
        doctor.run("trn3", quiet=True)


def _fake_sdk_dir():
    from tests.compile.conftest import FAKE_SDK

    return FAKE_SDK
