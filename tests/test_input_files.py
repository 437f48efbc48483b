"""Input files that are not what they claim, through the CLI where the third hostile probe saw them:
a FIFO (or other non-regular file) where a file is read is refused at once instead of blocking in
open(); a number that overflows a double and a key given twice are not JSON gkbuild accepts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gkbuild import text
from gkbuild.checkpoint.source import parse
from gkbuild.errors import GkError
from gkbuild.golden import Golden
from gkbuild.pipeline import manifest as mf
from tests.conftest import RECIPES

DEADLINE = 60  # seconds: a CLI start on a loaded host, far below "forever"


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, under a deadline (the failure this file guards against is a hang)."""
    return subprocess.run([sys.executable, "-m", "gkbuild", *args], capture_output=True, text=True, timeout=DEADLINE)


def _one_line(r: subprocess.CompletedProcess, *match: str) -> None:
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gkbuild: error:"), r.stderr
    assert all(m in lines[0] for m in match), r.stderr


def _fifo(p) -> str:
    if os.path.lexists(p):
        os.unlink(p)
    os.mkfifo(p)
    return str(p)


@pytest.fixture
def public_key(tmp_path) -> str:
    k = ec.generate_private_key(ec.SECP256R1())
    p = tmp_path / "ci.pub"
    p.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return str(p)


def test_a_fifo_signature_beside_a_build_is_refused_without_blocking(build, public_key):
    _fifo(build / "manifest.sig")
    (build / "provenance.json").write_text("{}")
    _one_line(_cli("verify-signature", str(build), "--trust", public_key), "manifest.sig: is a FIFO, not a regular file")


def test_a_fifo_recipe_is_refused_without_blocking(tmp_path):
    _one_line(_cli("di", "plan", _fifo(tmp_path / "r.yaml")), "r.yaml: is a FIFO")
    shutil.copy(RECIPES / "tiny-cpu.yaml", tmp_path / "ok.yaml")  # the same command on a real file still works
    assert _cli("di", "plan", str(tmp_path / "ok.yaml"), "--prefill-tp", "2").returncode == 0


def _refused_without_blocking(fifo: str, fn, *args) -> str:
    """The one-line GkError ``fn(*args)`` raises, in a thread: when it is still blocked on ``fifo``
    after the deadline, a writer's open lets it go, and the test fails."""
    got = {}

    def run():
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked open() returns (and reads EOF)
        t.join()
        pytest.fail(f"{getattr(fn, '__qualname__', fn)} blocked in open() on the FIFO {fifo}")
    e = got.get("error")
    assert isinstance(e, GkError) and "\n" not in str(e), repr(e)
    return str(e)


def test_a_fifo_golden_manifest_or_tokenizer_file_is_refused_without_blocking(build, tiny_copy, tmp_path):
    fifo = _fifo(tmp_path / "g.safetensors")
    assert "g.safetensors: is a FIFO" in _refused_without_blocking(fifo, Golden.load, fifo)
    fifo = _fifo(build / mf.NAME)
    assert "manifest.json: is a FIFO" in _refused_without_blocking(fifo, mf.load, build)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        ck = tmp_path / name
        shutil.copytree(tiny_copy, ck)
        fifo = _fifo(ck / name)
        assert f"{name}: is a FIFO" in _refused_without_blocking(fifo, text.tokenizer, parse(str(ck)))


def test_a_manifest_with_a_number_that_overflows_a_double_is_a_bad_file(build):
    text = (build / mf.NAME).read_text()
    assert '"eps": 1e-05' in text
    (build / mf.NAME).write_text(text.replace('"eps": 1e-05', '"eps": 1e400', 1))
    _one_line(_cli("inspect", str(build)), "manifest.json: not valid JSON (1e400 overflows a double)")


def test_a_manifest_with_a_key_twice_is_a_bad_file(build):
    text = (build / mf.NAME).read_text()
    (build / mf.NAME).write_text('{"name": "evil",' + text.lstrip()[1:])  # the real name comes later and "wins"
    _one_line(_cli("inspect", str(build)), 'manifest.json: not valid JSON (key "name" appears twice in an object)')
