"""hf:// sources against a hub cache laid out by hand (snapshots + refs), the hub unreachable."""

import os
import shutil
import subprocess
import sys

import pytest

from gkbuild.checkpoint import hub
from gkbuild.checkpoint.reader import Checkpoint
from gkbuild.checkpoint.source import materialize, model_config, parse
from gkbuild.errors import GkError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tiny_ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--gpt-oss-tiny"
    snap = repo / "snapshots" / COMMIT
    shutil.copytree(tiny_ckpt, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return cache


def test_parse():
    assert hub.parse("hf://openai/gpt-oss-120b@abc").revision == "abc"
    assert hub.parse("hf://openai/gpt-oss-120b").revision == "main"
    for bad in ("hf://nope", "hf:///x/y", "hf://a/b@"):
        with pytest.raises(GkError, match="expected hf://ORG/NAME"):
            hub.parse(bad)


@pytest.mark.parametrize("rev", ["main", COMMIT])
def test_resolves_from_the_cache_offline(hub_cache, rev):
    ref, path = hub.resolve(f"hf://acme/gpt-oss-tiny@{rev}")
    assert path.name == COMMIT
    assert Checkpoint.open(path).config.L == 2


def test_model_config_and_materialize(hub_cache):
    spec = parse("hf://acme/gpt-oss-tiny@main")
    assert model_config(spec).E == 8
    assert materialize(spec).name == COMMIT


def test_uncached_revision_is_a_clear_error(hub_cache):
    with pytest.raises(GkError, match=r"revision 'v2' is not in the local HF cache .* unreachable"):
        hub.resolve("hf://acme/gpt-oss-tiny@v2")


def test_unreachable_hub_without_offline_flag(hub_cache):
    """A real unreachable endpoint (no offline flag) gives the same one-line message."""
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    code = ("from gkbuild.checkpoint.hub import resolve\n"
            "from gkbuild.errors import GkError\n"
            "try:\n    resolve('hf://acme/gpt-oss-tiny@v9')\nexcept GkError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                         text=True, timeout=120)
    assert "revision 'v9' is not in the local HF cache" in out.stdout and "unreachable" in out.stdout
