"""Planning is cheap: a no-op compile (every stage cached) and a farm's planning import none of the
heavy libraries (torch, transformers, s3fs, ml_dtypes, jsonschema; a no-op not even numpy or the
process pool); each costs a large part of the 0.5 s a no-op build may take as a whole process
(bench/bench_noop.py measures it)."""

import json
import subprocess
import sys

from tests.conftest import RECIPES, run_cli

HEAVY = ("torch", "transformers", "s3fs", "ml_dtypes", "jsonschema", "boto3", "ray")
PROBE = """
import json, sys
from gkbuild.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))))
"""


def _imported(*args: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    r = subprocess.run([sys.executable, "-c", f"HEAVY = {heavy!r}\n" + PROBE, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_no_op_compile_imports_nothing_heavy(tmp_path):
    out = tmp_path / "b"
    recipe = str(RECIPES / "tiny-topology-trn3.yaml")  # 128 ranks; its NEFF stage is skipped here
    first = run_cli("compile", recipe, "--out", str(out), "-q")
    assert first.returncode == 0, first.stderr
    assert _imported("compile", recipe, "--out", str(out), "-q", "--json",
                     heavy=HEAVY + ("numpy", "multiprocessing")) == []


def test_planning_a_farm_imports_nothing_heavy(tmp_path):
    assert _imported("farm", str(RECIPES / "tiny-cpu.yaml"), str(RECIPES / "tiny-topology-trn3.yaml"),
                     "--cache", str(tmp_path / "c"), "--list", "--json") == []


def test_building_mxfp4_shards_imports_no_ml_dtypes(topo_ckpt, tmp_path):
    """Shards move bf16 as u16 bits: neither the build nor any of its workers imports ml_dtypes
    (0.6 s of start-up). ``-X importtime`` is inherited by the forked workers and reports theirs.
    (The checkpoint exists already: synthesizing one does use ml_dtypes.)"""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "gkbuild", "compile",
                        str(RECIPES / "tiny-topology-trn3.yaml"), "--out", str(tmp_path / "b"), "--no-compile", "-q",
                        "--set", f"source={topo_ckpt}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "b" / "manifest.json").exists()
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "gkbuild.pipeline.emit" in imported
    assert not [m for m in imported if m.split(".")[0] == "ml_dtypes"]
