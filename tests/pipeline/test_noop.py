"""A no-op build (every stage cached) reads its manifest back instead of assembling and hashing it
again, but only while everything the manifest is made of, and the file itself, are unchanged."""

import os

import pytest

from gkbuild import recipe
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.pipeline import compile_build
from tests.conftest import RECIPES


def _build(out):
    return compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=out, quiet=True, compile=False)


@pytest.fixture
def made(monkeypatch):
    """Counts the manifests assembled (``mf.make`` calls)."""
    calls = []
    make = mf.make
    monkeypatch.setattr(mf, "make", lambda *a: calls.append(1) or make(*a))
    return calls


def test_a_no_op_reads_the_manifest_back(build, made):
    first = _build(build)  # a copy of a build: its manifest's stat is not the one recorded
    data = (build / mf.NAME).read_bytes()
    again = _build(build)
    assert len(made) == 1 and not again.did_work
    assert again.manifest == first.manifest and (build / mf.NAME).read_bytes() == data


def test_a_touched_manifest_or_new_tools_are_assembled_again(build, made, monkeypatch):
    _build(build)
    st = os.stat(build / mf.NAME)
    os.utime(build / mf.NAME, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert not _build(build).did_work and len(made) == 2  # same content: assembled, not rewritten
    tools = mf.tool_versions()
    monkeypatch.setattr(mf, "tool_versions", lambda: {**tools, "numpy": "0.0-test"})
    res = _build(build)
    assert len(made) == 3 and res.manifest["tools"]["numpy"] == "0.0-test"
    assert mf.load(build)["tools"]["numpy"] == "0.0-test"
