"""The Neuron programs against the published kernels' interfaces, argument by argument.

- The committed interfaces are what the extraction script reads from the sources.
- Every program's argument set fits its revision's interface: nothing missing, nothing extra.
- Every trn2 / trn3 tiny-topology configuration traces through a fake SDK as strict as the documented
  one, against stand-ins built from those interfaces, with every kernel switch set explicitly; and
  verifies with the twins.
- Each defect the held-out run found (issue 17) has a test here that fails on the code before it.
"""

import dataclasses
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from gkbuild import recipe, reference, verify
from gkbuild.checkpoint.synth import synthesize
from gkbuild.compile import conformance, interface, kernel_source, neuron, rules, signature, switches
from gkbuild.errors import GkError
from gkbuild.golden import default_prompts, for_checkpoint
from gkbuild.model import FULL, SLIDING, preset
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.plan import make_plan
from tests.compile.conftest import LIB_A, LIB_F, STANDINS
from tests.conftest import RECIPES, run_cli

# Where the published texts live on a machine that has them (they are not in this repository).
SOURCES = Path(os.environ.get("GKBUILD_KERNEL_SOURCES", "/work/srcs"))
DECODE_PATH = "src/nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental/gpt_oss/gpt_oss_decode_layer_dp_tp_ep.py"
TAIL_PATH = "src/nkilib_src/nkilib/experimental/gpt_oss_tail/tail_chunked_megakernel.py"
HELPERS_PATH = "src/nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/core/utils/kernel_helpers.py"
FP8_FLAG = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


def _doc(revision):
    repo, _, commit = revision.partition("@")
    return interface.load(repo, commit)


# -- the interfaces -------------------------------------------------------------------------------------
@pytest.mark.parametrize("revision, entries, scan", [
    (kernel_source.A, [f"{DECODE_PATH}:gpt_oss_decode_mega_kernel"], []),
    (kernel_source.F, [f"{DECODE_PATH}:gpt_oss_decode_mega_kernel", f"{TAIL_PATH}:gpt_oss_tail_chunked_megakernel"],
     [HELPERS_PATH]),
])
def test_the_committed_interfaces_are_what_the_script_extracts(revision, entries, scan):
    repo, _, commit = revision.partition("@")
    root = SOURCES / f"{repo.replace('/', '+')}@{commit}"
    if not (root / DECODE_PATH).is_file():
        pytest.skip(f"the published text of {revision} is not on this machine (set GKBUILD_KERNEL_SOURCES to a "
                    f"folder holding OWNER+REPO@COMMIT checkouts); the committed file's sha256 still pins it")
    assert interface.extract(root, repo, commit, entries, scan) == _doc(revision)


def test_extraction_reads_parameters_and_every_way_a_switch_is_read(tmp_path):
    src = tmp_path / "lib" / "src" / "nkilib_src" / "nkilib" / "k.py"
    src.parent.mkdir(parents=True)
    src.write_text(
        "import os as _os\n"
        "from .h import mega_flag_default_on as _mega_flag_default_on\n"
        "_P = _os.environ.get('VLLM_NEURON_MEGA_P', '1') != '0'\n"
        "def kern(a: nl.ndarray, b, *, c: int = 3, d=None, e=1e-5):\n"
        "    x = bool(_os.environ.get('VLLM_NEURON_MEGA_T'))\n"
        "    if _os.environ.get('VLLM_NEURON_MEGA_IF'):\n"
        "        pass\n"
        "    y = _mega_flag_default_on('VLLM_NEURON_MEGA_ON')\n"
        "    z = _os.environ.get('OTHER_VAR')\n"
        "    w = _os.getenv('VLLM_NEURON_MEGA_GE', 'x') == 'y'\n"
        "_FLAG_OFF_VALUES = ('', '0')\n")
    doc = interface.extract(tmp_path / "lib", "o/r", "c" * 40, ["src/nkilib_src/nkilib/k.py:kern"])
    e = doc["entries"]["kern"]
    assert e["module"] == "nkilib.k" and e["line"] == 4
    assert [(p["name"], p["required"], p["default"], p["kind"]) for p in e["params"]] == [
        ("a", True, None, "positional_or_keyword"), ("b", True, None, "positional_or_keyword"),
        ("c", False, "3", "keyword_only"), ("d", False, "None", "keyword_only"), ("e", False, "1e-05", "keyword_only")]
    assert e["params"][0]["annotation"] == "nl.ndarray"
    assert [(s["name"].removeprefix("VLLM_NEURON_MEGA_"), s["read"], s["default"]) for s in doc["switches"]] == [
        ("P", "value", "1"), ("T", "truthy", None), ("IF", "truthy", None), ("ON", "default_on", None),
        ("GE", "value", "x")]
    assert doc["flag_off_values"] == ["", "0"]
    assert doc["files"]["src/nkilib_src/nkilib/k.py"] == __import__("hashlib").sha256(src.read_bytes()).hexdigest()
    with pytest.raises(GkError, match="defines no module-level function 'missing'"):
        interface.extract(tmp_path / "lib", "o/r", "c" * 40, ["src/nkilib_src/nkilib/k.py:missing"])
    # a read gkbuild cannot classify is refused (it cannot be set explicitly), never guessed
    (src.parent / "m.py").write_text("import os\nON = 'VLLM_NEURON_MEGA_IN' in os.environ\nX = os.environ['NKI_X']\n")
    reads, off, other = interface.scan_switches(tmp_path / "lib")
    assert ("VLLM_NEURON_MEGA_IN", "unrecognized") in {(r["name"], r["read"]) for r in reads}
    assert other == ["NKI_X", "OTHER_VAR"] and off == ["", "0"]
    with pytest.raises(GkError, match=r"m.py:2: VLLM_NEURON_MEGA_IN is read as `'VLLM_NEURON_MEGA_IN' in os.environ`"):
        switches.settings(reads, off, {}, "r")


def test_the_stand_ins_are_built_from_the_interfaces():
    """Each stand-in's parameter list is its revision's; its switch reads are written from the
    interface (the files a build scans), and say the same thing back."""
    import sys

    sys.path.insert(0, str(STANDINS))
    try:
        import standin
    finally:
        sys.path.remove(str(STANDINS))
    gen = STANDINS / "A" / DECODE_PATH.replace("gpt_oss_decode_layer_dp_tp_ep.py", "_switches.py")
    assert gen.read_text() == standin.switch_module(kernel_source.A, None)
    gen = STANDINS / "F" / DECODE_PATH.replace("gpt_oss_decode_layer_dp_tp_ep.py", "_switches.py")
    assert gen.read_text() == standin.switch_module(kernel_source.F, "nkilib.models.gpt_oss.c128_giga_kernel.core."
                                                                     "utils.kernel_helpers")
    assert (STANDINS / "F" / HELPERS_PATH).read_text() == standin.helpers_module(kernel_source.F)
    for rev, lib in ((kernel_source.A, LIB_A), (kernel_source.F, LIB_F)):
        reads, off, _ = interface.scan_switches(lib)
        doc = _doc(rev)
        want = {(s["name"], s["read"], s["default"]) for s in doc["switches"]}
        got = {(s["name"], s["read"], s["default"]) for s in reads}
        assert want <= got, want - got
        extra = {g[0] for g in got - want}
        assert extra <= {"VLLM_NEURON_MEGA_SCALE_PACK64"}  # F's MoE module (see its stand-in)
        assert off == doc["flag_off_values"]
    decode = standin.signature(kernel_source.F, "gpt_oss_decode_mega_kernel")
    assert list(decode.parameters) == [p["name"] for p in
                                       _doc(kernel_source.F)["entries"]["gpt_oss_decode_mega_kernel"]["params"]]


# -- the argument sets ----------------------------------------------------------------------------------
# trn2 / trn3, stacked / paired, fp8 / bf16, embedding host / vocab / hidden, RoPE host / fused,
# B 128 / 256, emit_logits on / off: every value, most pairs.
CONFIGS = {
    "trn2-stacked-fp8-host-b128": ["target=trn2"],
    "trn3-stacked-fp8-host-b256-nologits": ["target=trn3", "decode.batch_sizes=[256]", "tail.emit_logits=false"],
    "trn2-paired-fp8-vocab-fused-nologits": ["target=trn2", "kv_cache.form=paired", "decode.embedding=vocab",
                                             "decode.rope=fused", "tail.emit_logits=false"],
    "trn3-paired-bf16-hidden-b256": ["target=trn3", "kv_cache.form=paired", "kv_cache.dtype=bf16",
                                     "kv_cache.packed=false", "decode.embedding=hidden", "decode.batch_sizes=[256]"],
    "trn2-stacked-bf16-hidden-fused-b256": ["target=trn2", "kv_cache.dtype=bf16", "kv_cache.packed=false",
                                            "decode.embedding=hidden", "decode.rope=fused", "decode.batch_sizes=[256]"],
    "trn3-stacked-fp8-vocab": ["target=trn3", "decode.embedding=vocab"],
    "trn2-paired-bf16-host-fused": ["target=trn2", "kv_cache.form=paired", "kv_cache.dtype=bf16",
                                    "kv_cache.packed=false", "decode.rope=fused"],
    "trn3-paired-fp8-hidden-fused-nologits": ["target=trn3", "kv_cache.form=paired", "decode.embedding=hidden",
                                              "decode.rope=fused", "tail.emit_logits=false"],
}


def _recipe(sets, libraries=False):
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml", list(sets))
    if libraries:  # the stand-in trees, chosen as gkbuild chooses the published revisions
        lib = LIB_F if kernel_source.fork_forms(r) else LIB_A
        r = recipe.load(RECIPES / "tiny-topology-trn3.yaml", [*sets, f"compile.kernels.decode.library={lib}",
                                                             f"compile.kernels.tail.library={LIB_F}"])
    return r


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_argument_is_one_the_chosen_revision_takes(name):
    """Against the committed interface of the revision each program defaults to: every required
    parameter passed, no parameter the revision lacks (the tests before issue 17 passed K_cache_buf_*,
    dropped x_shard and cos/sin for the fused forms, and wrapped hop_meshes)."""
    p = make_plan(_recipe(CONFIGS[name]), preset("tiny-topology"))
    for sig in signature.programs(p):
        library, entry = kernel_source.chosen(p.recipe, sig.program)
        params = kernel_source.entry_parameters(_doc(library), entry)
        missing, extra = conformance.mismatch(params, sig.names() + list(sig.scalars))
        assert not missing and not extra, (sig.key, library, missing, extra)
        if sig.program == "decode":
            assert "x_shard" in sig.names() and {"cos", "sin"} <= set(sig.names())
            assert library == (kernel_source.F if kernel_source.fork_forms(p.recipe) else kernel_source.A)


@pytest.mark.parametrize("sets, message", [
    (["kv_cache.form=paired"], r"lacks kv_cache_update_idx_swa \(kv_cache.form: paired\); kv_cache.form: paired needs "
                               r"baonudesifeizhai/nki-library@9f2490f6"),
    (["decode.rope=fused"], r"lacks inv_freq \(decode.rope: fused\), rope_concentration"),
    (["decode.embedding=hidden"], r"lacks embed_weight .* embed_x_shard_ids"),
])
def test_a_form_the_chosen_revision_lacks_is_refused_at_plan(sets, message):
    with pytest.raises(GkError, match=message) as e:
        make_plan(recipe.load(RECIPES / "tiny-topology-trn3.yaml", [*sets, f"compile.kernels.decode.library="
                                                                           f"{kernel_source.A}"]),
                  preset("tiny-topology"))
    assert "\n" not in str(e.value) and "decode-b128 program does not fit" in str(e.value)


def test_a_missing_or_extra_argument_is_refused(monkeypatch):
    """A program that passes an argument the revision lacks, or omits one it requires, is refused
    before anything is traced."""
    orig = signature.neuron_decode

    def with_inputs(change):
        def changed(plan, batch):
            s = orig(plan, batch)
            return signature.Signature(s.program, tuple(change(list(s.inputs))), s.outputs, s.batch, s.scalars)
        return changed

    monkeypatch.setattr(signature, "neuron_decode", with_inputs(
        lambda ins: ins + [signature.Input("K_cache_buf_0", (1,), "uint8", "kv_buffer")]))
    with pytest.raises(GkError, match=r"the kernel lacks K_cache_buf_0"):
        make_plan(_recipe([]), preset("tiny-topology"))
    monkeypatch.setattr(signature, "neuron_decode", with_inputs(lambda ins: [i for i in ins if i.name != "x_shard"]))
    with pytest.raises(GkError, match=r"the kernel requires x_shard"):
        make_plan(_recipe([]), preset("tiny-topology"))
    monkeypatch.setattr(signature, "neuron_decode", orig)
    with pytest.raises(GkError, match=r"compile.kernels.tail: aws-neuron/nki-library@e9ef98fc\w+ has no "
                                      r"nkilib.experimental.gpt_oss_tail"):
        make_plan(_recipe([f"compile.kernels.tail.library={kernel_source.A}"]), preset("tiny-topology"))


# -- the switches -----------------------------------------------------------------------------------------
def test_every_switch_is_set_explicitly_to_the_reference_path():
    """A: absent is off and "0" is ON; F: absent is ON. gkbuild sets each so both take the path
    the twins model, KV write-back on."""
    for rev, off in ((kernel_source.A, ""), (kernel_source.F, "0")):
        doc = _doc(rev)
        env = switches.environment(switches.settings(doc["switches"], doc["flag_off_values"], {}, "r"))
        assert env["VLLM_NEURON_MEGA_KV_UPDATE"] == "1"
        assert env["VLLM_NEURON_MEGA_FP8_RS"] == off and env["VLLM_NEURON_MEGA_PREQUANT_MOE"] == off
        assert env["VLLM_NEURON_MEGA_FP8_RS_SCALE"] == "1"  # a value switch at its source default
        assert set(env) == {s["name"] for s in doc["switches"]}
    doc = _doc(kernel_source.F)
    for asked, message in (({"VLLM_NEURON_MEGA_KV_UPDATE": "0"}, "turns the KV write-back off"),
                           ({"VLLM_NEURON_MEGA_KV_UPDATE": "false"}, "turns the KV write-back off"),
                           ({"VLLM_NEURON_MEGA_NOPE": "1"}, r"\['VLLM_NEURON_MEGA_NOPE'\] are not read")):
        with pytest.raises(GkError, match=message):
            switches.settings(doc["switches"], doc["flag_off_values"], asked, "r")
    a = _doc(kernel_source.A)
    with pytest.raises(GkError, match="turns the KV write-back off"):
        switches.settings(a["switches"], a["flag_off_values"], {"VLLM_NEURON_MEGA_KV_UPDATE": ""}, "r")
    lossy = switches.settings(doc["switches"], doc["flag_off_values"], {"VLLM_NEURON_MEGA_FP8_RS": "1"}, "r")
    rec = {"switches": {s.name: s.to_dict() for s in lossy}}
    assert switches.lossy_on(rec) == ["VLLM_NEURON_MEGA_FP8_RS=1"]


def test_recipe_doc_lists_each_revisions_switches():
    r = run_cli("recipe-doc", "--json")
    tables = json.loads(r.stdout)["switches"]
    f = {e["name"]: e for e in tables["baonudesifeizhai/nki-library@9f2490f6"]}
    assert f["VLLM_NEURON_MEGA_FP8_RS"]["numerics"] == "lossy" and f["VLLM_NEURON_MEGA_FP8_RS"]["value"] == "0"
    assert f["VLLM_NEURON_MEGA_KV_UPDATE"]["value"] == "1" and f["VLLM_NEURON_MEGA_KV_UPDATE"]["read"] == "default_on"
    a = {e["name"]: e for e in tables["aws-neuron/nki-library@e9ef98fc"]}
    assert a["VLLM_NEURON_MEGA_FP8_RS"]["value"] == "" and a["VLLM_NEURON_MEGA_FP8_RS"]["read"] == "truthy"
    assert "VLLM_NEURON_MEGA_SBUF_INTERLAYER" in run_cli("recipe-doc").stdout


# -- FP8 on trn2 ------------------------------------------------------------------------------------------
def test_fp8_e4m3_and_e4m3fn_codes_agree_within_240():
    """Every one of the 256 codes: where IEEE e4m3 (trn2) is finite its value is e4m3fn's (same bits),
    and e4m3fn's codes past 240 are exactly IEEE e4m3's inf/NaN codes, which saturating at 240 never
    produces."""
    codes = np.arange(256, dtype=np.uint8)
    ieee = codes.view(ml_dtypes.float8_e4m3).astype(np.float32)
    fn = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()
    finite = np.isfinite(ieee)
    assert finite.sum() == 240 and np.abs(ieee[finite]).max() == 240
    assert np.array_equal(ieee[finite], fn[finite]) and np.array_equal(np.signbit(ieee[finite]), np.signbit(fn[finite]))
    assert ((codes[~finite] & 0x78) == 0x78).all()  # exponent field 15: only there do the formats part
    # the twin's rounding (clamp to +-240, then float8_e4m3fn) gives IEEE e4m3's saturating bits
    x = np.concatenate([np.linspace(-300, 300, 20001, dtype=np.float32), np.float32([2.0 ** -9, 2.0 ** -10, 3e-3,
                                                                                      239.9, 240.0, 247.9, 248.0])])
    clamped = np.clip(x, -240, 240)
    ours = torch.from_numpy(clamped).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    want = clamped.astype(ml_dtypes.float8_e4m3).view(np.uint8)
    assert np.array_equal(ours, want)
    assert ((ours & 0x78) != 0x78).all()


# -- through the fake SDK and the stand-ins ---------------------------------------------------------------
def _sdk_log(logs):
    return [json.loads(line) for line in logs["sdk"].read_text().splitlines()]


def _outputs(out, key):
    return json.loads((out / ".gkbuild" / "neuron" / key / "outputs.json").read_text())


@pytest.fixture(scope="module")
def goldens():
    """Small goldens (2 prompts, 3 + 1 positions) of the tiny-topology checkpoint, one a KV format."""
    made = {}

    def golden(fmt, root=None):
        key = (str(fmt), str(root))
        if key not in made:
            made[key] = for_checkpoint(root or _topo_root(), default_prompts(2048, 2, 3), 1, fmt)
        return made[key]

    return golden


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_configuration_traces_and_verifies(name, fake_sdk, tmp_path, goldens):
    """trn3: traces against the stand-ins, every switch set, and verifies tight with the twins. trn2:
    the published kernels' MoE multiplies MX tiles with nc_matmul_mx, which NKI documents as
    NeuronCore-v4 (Trn3) only, so the trace is refused in one line; the build's shards and layout
    still verify with the twins."""
    sets = CONFIGS[name]
    out = tmp_path / "b"
    r = _recipe(sets, libraries=True)
    B = r.decode.batch_sizes[0]
    if r.target == "trn2":
        with pytest.raises(GkError, match=r"^trn2: the decode-b\d+ program is refused by nc_matmul_mx: the MX MoE "
                                          r"\(src/nkilib_src/.*/moe_block_tkg_utils.py:\d+"):
            compile_build(r, out=out, quiet=True, require_neff=True)  # the stand-in tree's scan, before any trace
        res = compile_build(r, out=out, quiet=True, compile=False)
    else:
        res = compile_build(r, out=out, quiet=True, require_neff=True)
        _traced(res, r, sets, out, fake_sdk)
    assert run_cli("check", str(out), "-q").returncode == 0
    # and the build decodes what the reference does, through the twins
    rep = verify.run(out, golden=goldens(reference.build_kv(mf.load(out))))
    assert rep.ok and rep.kv == "tight", (name, rep.to_dict())
    assert not rep.unmodeled


def _traced(res, r, sets, out, fake_sdk):
    """What a traced build holds: both NEFFs, what the kernels returned, every switch set in the
    documented host mode."""
    c = res.manifest["compile"]
    B = r.decode.batch_sizes[0]
    assert c["status"] == "ok" and [a["name"] for a in c["artifacts"]] == [f"decode-b{B}", f"tail-b{B}"]
    p = make_plan(r, preset("tiny-topology"))
    dec_sig, tail_sig = signature.neuron_decode(p, B), signature.neuron_tail(p, B)
    for a in c["artifacts"]:
        assert a["path"] == f"compiled/{a['name']}.neff" and a["neff"]["lnc_size"] == 1
        assert (out / a["path"]).stat().st_size == a["size"]
    # what the traced kernels returned: x and the K/V it wrote (aliased), the tail's outputs in order
    dec = _outputs(out, f"decode-b{B}")
    kv_dt = "torch.bfloat16" if "kv_cache.dtype=bf16" in sets else "torch.float8_e4m3fn"
    assert dec == [[[B // 128, 512], "torch.bfloat16"], [list(dec_sig.input("K_cache").shape), kv_dt],
                   [list(dec_sig.input("V_cache").shape), kv_dt]]
    assert [o[0] for o in _outputs(out, f"tail-b{B}")] == [o["shape"] for o in tail_sig.outputs]
    # each trace: the documented host mode, every switch set, no stray passed on
    log = _sdk_log(fake_sdk)
    assert len(log) == 2 and all(e["cpu_backend"] and e["target"] == r.target and e["pjrt"] is None for e in log)
    for e, a in zip(log, c["artifacts"]):
        assert e["switches"] == {n: s["value"] for n, s in a["kernel"]["switches"].items()}
        assert e["switches"]["VLLM_NEURON_MEGA_KV_UPDATE"] == "1"
        assert e["switches"].get("VLLM_NEURON_MEGA_SBUF_INTERLAYER") in ("", "0")
        assert (FP8_FLAG in e["args"]) == (a["program"] == "decode" and r.target == "trn2"
                                           and "kv_cache.dtype=bf16" not in sets)
    if kernel_source.fork_forms(r):
        assert log[0]["switches"]["VLLM_NEURON_MEGA_SCALE_PACK64"] == "0"  # F's layout switch, found by the scan


def _own_library(tmp_path):
    """A decode kernel of one's own with A's interface and a MoE without nc_matmul_mx: what a trn2
    build needs (no published revision has it)."""
    import shutil

    lib = tmp_path / "own"
    shutil.copytree(LIB_A, lib)
    (lib / DECODE_PATH).write_text((LIB_A / DECODE_PATH).read_text().replace(
        "moe=validate_moe_block_inputs", "moe=None, mx_moe=False"))
    rm = lib / DECODE_PATH.replace("experimental/gpt_oss/gpt_oss_decode_layer_dp_tp_ep.py", "core/moe")
    shutil.rmtree(rm)  # no MX MoE: nothing of it is reachable
    (lib / DECODE_PATH).write_text((lib / DECODE_PATH).read_text().replace(
        "from ...core.moe.moe_tkg.moe_block_tkg_utils import validate_moe_block_inputs\n", ""))
    return lib


@pytest.mark.slow
def test_trn2_fp8_traces_with_a_trn2_kernel_and_needs_the_e4m3_flag(fake_sdk, tmp_path, goldens):
    """With a decode kernel whose MoE runs on NeuronCore-v3, a trn2 FP8 build traces: K/V as
    float8_e4m3fn and the compiler flag NCC_EVRF051 asks for; without the flag the compiler refuses."""
    lib = _own_library(tmp_path)
    sets = ["target=trn2", f"compile.kernels.decode.library={lib}", f"compile.kernels.tail.library={LIB_F}"]
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml", sets)
    res = compile_build(r, out=tmp_path / "b", quiet=True, require_neff=True)
    _traced(res, r, sets, tmp_path / "b", fake_sdk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(neuron, "FP8_ON_TRN2", "--not-the-flag")
        with pytest.raises(GkError, match=r"^decode-b128: torch_neuronx.trace failed: RuntimeError: NCC_EVRF051"):
            compile_build(r, out=tmp_path / "c", quiet=True, require_neff=True)


def test_the_published_decode_on_trn2_is_refused_before_anything_is_traced(fake_sdk, tmp_path):
    """The published revisions' MoE needs NeuronCore-v4 (rule nc_matmul_mx): with the SDK present a
    trn2 compile stops before the checkout, in one line; so does `gkbuild plan`."""
    with pytest.raises(GkError, match=r"^trn2: the decode-b128 program is refused by nc_matmul_mx: the MX MoE "
                                      r"\(moe_block_tkg_utils.py:parse_moe_block_config\) .* trn2 is NeuronCore-v3"):
        compile_build(_recipe(["target=trn2"]), out=tmp_path / "b", quiet=True, require_neff=True)
    assert not (tmp_path / "b").exists()  # refused before anything is written
    assert rules.refusal(rules.plan_verdicts(make_plan(_recipe(["target=trn3"]), preset("tiny-topology")))) is None
    r = run_cli("plan", str(RECIPES / "tiny-topology-trn3.yaml"), "--set", "target=trn2")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "refused by nc_matmul_mx" in r.stderr, r.stderr
    # past the rule, the kernel itself refuses on the fake SDK: its MoE's nc_matmul_mx needs NeuronCore-v4
    from gkbuild.compile import stage

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage, "_refuse", lambda plan, profile, roots=None: None)
        with pytest.raises(GkError, match=r"^decode-b128: the decode kernel refused its arguments: RuntimeError: "
                                          r"nc_matmul_mx is available only on NeuronCore-v4 and newer; target trn2"):
            compile_build(_recipe(["target=trn2"], libraries=True), out=tmp_path / "c", quiet=True, require_neff=True)


def _topo_root():
    from gkbuild.checkpoint.source import materialize, parse

    return materialize(parse("synth://tiny-topology?layers=2&seed=0"))


@pytest.mark.slow
def test_paired_layers_share_entries_at_four_layers(fake_sdk, tmp_path, goldens):
    """Four layers, paired: two entries, layer i reading entry i // 2 (at two layers the single entry
    is also the kernel's 'shared' case). Traces against F, and verifies."""
    cfg4 = dataclasses.replace(preset("tiny-topology"), num_hidden_layers=4,
                               layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(4)))
    ck = synthesize(cfg4, tmp_path / "ck4", seed=0)
    r = _recipe(["target=trn3", "kv_cache.form=paired", f"source={ck}"], libraries=True)
    out = tmp_path / "b"
    compile_build(r, out=out, quiet=True, require_neff=True)
    dec = _outputs(out, "decode-b128")
    assert dec[1][0] == [2, 96, 1, 2, 32, 2] and dec[2][0] == [2, 96, 1, 4, 32]
    rep = verify.run(out, golden=goldens(reference.build_kv(mf.load(out)), ck))
    assert rep.ok and rep.kv == "tight", rep.to_dict()


@pytest.mark.slow
def test_what_the_held_out_run_found_fails_here(fake_sdk, tmp_path):
    """The strict fake and the stand-ins refuse what the earlier build did, each in one line."""
    from gkbuild.compile import neuron_trace

    # 1. a tail handed ReplicaGroups: the kernel reads len(mesh[0]) of an opaque object
    out = tmp_path / "rg"
    import sys

    sys.path[:0] = [str(STANDINS), str(LIB_F / "src" / "nkilib_src")]
    try:
        from nki.collectives import ReplicaGroup
        from nkilib.experimental.gpt_oss_tail.tail_chunked_megakernel import gpt_oss_tail_chunked_megakernel as tail

        p = make_plan(_recipe([]), preset("tiny-topology"))
        sig = signature.neuron_tail(p, 128)
        ins = {i.name: neuron_trace.tensor(i.to_dict()) for i in sig.inputs}
        sc = dict(sig.scalars)
        assert len(tail(**ins, **sc)) == 4
        with pytest.raises(TypeError, match="not subscriptable"):
            tail(**ins, **{**sc, "hop_meshes": tuple(ReplicaGroup(m) for m in sc["hop_meshes"])})
    finally:
        del sys.path[:2]
        for m in [m for m in sys.modules if m.startswith(("nkilib", "standin", "_checks", "_decode"))]:
            del sys.modules[m]
    # 3. F's switches left unset but the KV write-back (what gkbuild passed before): absent is ON in F,
    # and its default-on SCALE_PACK64 expects another layout of the gate/up scales than the shards hold
    orig_env = neuron.trace_environment
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(neuron, "trace_environment", lambda rec, target, base=None: {
            k: v for k, v in orig_env(rec, target, base).items()
            if not k.startswith("VLLM_NEURON_MEGA_") or k == switches.KV_UPDATE})
        with pytest.raises(GkError, match=r"SCALE_PACK64: gate/up scale must be \[E_L, 2, 64, H/512, I/4\]"):
            compile_build(_recipe(["target=trn3", "kv_cache.form=paired"], libraries=True), out=tmp_path / "sp",
                          quiet=True, require_neff=True)
    # ... and a recipe asking for it is refused before anything is traced
    with pytest.raises(GkError, match=r"VLLM_NEURON_MEGA_SCALE_PACK64=1 read the gate/up MX scales as"):
        compile_build(_recipe(["target=trn3", "kv_cache.form=paired",
                               "compile.kernel_switches=[VLLM_NEURON_MEGA_SCALE_PACK64=1]"],
                              libraries=True), out=tmp_path / "sp2", quiet=True, require_neff=True)
    # 4. without cpu_backend a NeuronCore is needed: the device mode says so in one line
    with pytest.raises(GkError, match=r"torch_neuronx.trace failed: RuntimeError: no Neuron device found"):
        compile_build(_recipe(["target=trn3", "compile.trace=device"], libraries=True), out=tmp_path / "dev",
                      quiet=True, require_neff=True)


@pytest.mark.slow
def test_the_undocumented_xla_cpu_mode_warns_and_uses_the_cli(fake_sdk, tmp_path, capsys):
    out = tmp_path / "x"
    compile_build(_recipe(["target=trn3", "compile.trace=xla-cpu"], libraries=True), out=out, quiet=True,
                  require_neff=True)
    assert "compile.trace: xla-cpu traces with torch-xla on PJRT_DEVICE=CPU" in capsys.readouterr().err
    argv = [json.loads(line) for line in fake_sdk["cc"].read_text().splitlines()]
    assert [a[:2] for a in argv] == [["compile", "--framework=XLA"]] * 2 and "--target=trn3" in argv[0]
    log = _sdk_log(fake_sdk)
    assert all(e.get("xla_device") and e["pjrt"] == "CPU" and e["target"] == "trn3" for e in log)


@pytest.mark.slow
def test_a_lossy_switch_is_recorded_and_named_by_verify(fake_sdk, tmp_path, goldens):
    out = tmp_path / "l"
    r = _recipe(["target=trn3", "kv_cache.form=paired", "compile.kernel_switches=[VLLM_NEURON_MEGA_FP8_RS=1]"],
                libraries=True)
    res = compile_build(r, out=out, quiet=True, require_neff=True)
    dec = res.manifest["compile"]["artifacts"][0]
    assert dec["kernel"]["switches"]["VLLM_NEURON_MEGA_FP8_RS"] == {**dec["kernel"]["switches"]["VLLM_NEURON_MEGA_FP8_RS"],
                                                                   "value": "1", "origin": "recipe", "numerics": "lossy"}
    assert res.manifest["compile"]["artifacts"][1]["kernel"]["switches"]["VLLM_NEURON_MEGA_FP8_RS"]["value"] == "0"
    assert verify.unmodeled_switches(res.manifest) == ["VLLM_NEURON_MEGA_FP8_RS=1"]
    golden = tmp_path / "g.safetensors"
    goldens(reference.build_kv(res.manifest)).save(golden)
    r = run_cli("verify", str(out), "--golden", str(golden))
    assert "VLLM_NEURON_MEGA_FP8_RS=1, numerics the twins do not model" in r.stdout, r.stdout + r.stderr
