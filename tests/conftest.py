"""Shared fixtures: synthesized checkpoints (made once per session) and a CLI runner."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gkbuild.checkpoint.synth import synthesize
from gkbuild.model import preset

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """tiny-cpu built without its compile (seconds), shared read-only; modules that need another
    build define their own ``built``."""
    from gkbuild import recipe
    from gkbuild.pipeline.pipeline import compile_build

    out = tmp_path_factory.mktemp("tiny-cpu") / "tiny-cpu"
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=out, quiet=True, compile=False)
    return out


@pytest.fixture
def build(built, tmp_path) -> Path:
    """A private copy of ``built`` a test may change."""
    dst = tmp_path / "build"
    shutil.copytree(built, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny preset, split over several files like a hub checkpoint."""
    return synthesize(preset("tiny"), tmp_path_factory.mktemp("ck") / "tiny", seed=0, max_shard_bytes=8 << 20)


@pytest.fixture(scope="session")
def topo_ckpt(tmp_path_factory) -> Path:
    return synthesize(preset("tiny-topology"), tmp_path_factory.mktemp("ck") / "topo", seed=0)


@pytest.fixture
def tiny_copy(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint a test may damage."""
    dst = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, dst)
    return dst


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """synth:// sources and fingerprints land in a per-session cache, never in the user's
    (session-wide, so module fixtures that build see the same cache as the tests)."""
    import os

    old = os.environ.get("GKBUILD_CACHE")
    os.environ["GKBUILD_CACHE"] = str(tmp_path_factory.getbasetemp() / "gkcache")
    yield
    if old is None:
        os.environ.pop("GKBUILD_CACHE", None)
    else:
        os.environ["GKBUILD_CACHE"] = old


@pytest.fixture(scope="module")
def one_thread():
    """Many small matmuls (the references, the twins) on a shared 2-core machine: one intra-op
    thread is several times faster than two contending with other processes."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess (exit codes and stderr as a user sees them)."""
    import os

    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "gkbuild", *args], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (moto) on 127.0.0.1 for the session, the AWS chain pointed at it; stopped
    at the end. Returns its endpoint URL."""
    from tests.s3server import moto_server

    with moto_server() as url:
        yield url


@pytest.fixture
def bucket(s3_server, request) -> str:
    """A new, empty bucket on the test server; its name."""
    import re

    import boto3

    name = re.sub(r"[^a-z0-9]+", "-", f"gk-{request.node.name.lower()}")[:50].strip("-") + f"-{id(request) % 10**6}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name
