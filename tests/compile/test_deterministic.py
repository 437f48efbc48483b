"""Two compiles of tiny-cpu, in fresh folders with fresh caches and the source copied elsewhere,
give the same bytes: manifest, shards and .pt2 programs. The model has one layer: the programs
unroll the layers, so one is as good a witness of determinism at half the compile time."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gkbuild.checkpoint.synth import synthesize
from gkbuild.model import preset
from tests.conftest import RECIPES


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".gkbuild" not in p.parts}


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> Path:
    return synthesize(preset("tiny").with_layers(1), tmp_path_factory.mktemp("ck") / "tiny1", seed=0)


@pytest.mark.slow
def test_two_compiles_are_byte_identical(one_layer, tmp_path):
    outs = []
    for i in (1, 2):
        home = tmp_path / f"host{i}"
        shutil.copytree(one_layer, home / "src" / "ck")
        text = (RECIPES / "tiny-cpu.yaml").read_text().replace("synth://tiny?layers=2&seed=0", "ck")
        (home / "src" / "tiny-cpu.yaml").write_text(text)
        env = dict(os.environ, GKBUILD_CACHE=str(home / "cache"), TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"))
        r = subprocess.run([sys.executable, "-m", "gkbuild", "compile", str(home / "src" / "tiny-cpu.yaml"),
                            "--out", str(home / "out"), "-q"], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(_tree(home / "out"))
    a, b = outs
    assert {"manifest.json", "compiled/decode.pt2", "compiled/tail.pt2"} <= a.keys()
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []
    for name in ("decode", "tail"):
        assert b"partial" not in a[f"compiled/{name}.pt2"] and str(tmp_path).encode() not in a[f"compiled/{name}.pt2"]
