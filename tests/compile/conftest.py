"""The fake Neuron SDK (``fake_sdk/``) and the stand-in kernel libraries (``standins/``), for the
tests that run the neuron backend's whole flow here."""

import os
from pathlib import Path

import pytest

from gkbuild.compile import neuron
from tests.conftest import ROOT

HERE = Path(__file__).resolve().parent
STANDINS, FAKE_SDK = HERE / "standins", HERE / "fake_sdk"
LIB_A, LIB_F = STANDINS / "A", STANDINS / "F"


@pytest.fixture
def fake_sdk(tmp_path, monkeypatch):
    """The fake SDK importable here and in the trace process, a fake neuronx-cc on PATH (for the
    xla-cpu mode), and the logs each writes: {"sdk": what each trace saw, "cc": neuronx-cc argv}."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    logs = {"cc": tmp_path / "cc_argv.jsonl", "sdk": tmp_path / "sdk.log"}
    cc = bindir / "neuronx-cc"
    cc.write_text(FAKE_CC.format(python=os.sys.executable, root=str(ROOT), log=str(logs["cc"])))
    cc.chmod(0o755)
    monkeypatch.syspath_prepend(str(FAKE_SDK))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SDK), str(STANDINS), str(ROOT)]))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("GK_FAKE_SDK_LOG", str(logs["sdk"]))
    monkeypatch.setenv("VLLM_NEURON_MEGA_SBUF_INTERLAYER", "1")  # a stray switch the build must not pass on
    assert neuron.sdk() is None
    return logs


FAKE_CC = '''#!{python}
"""A stand-in neuronx-cc for the xla-cpu mode: records its argv, writes a NEFF of the documented layout."""
import json, sys
sys.path.insert(0, {root!r})
from tests.compile.neff_files import make
argv = sys.argv[1:]
out = argv[argv.index("--output") + 1]
open(out, "wb").write(make(name=out.rsplit("/", 1)[-1], lnc=1))
with open({log!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
'''
