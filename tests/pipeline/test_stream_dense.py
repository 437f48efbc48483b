"""A bf16 fine-tune built by range: `compile --to` from an S3 source in transformers' dense layout
quantizes its experts as the streamed workers read them, into the same shards as a build from the
same checkpoint in a folder."""

import json
import os

import boto3
import pytest

from gkbuild.checkpoint.synth import synthesize
from gkbuild.model import preset
from gkbuild.publish.fetch import fetch
from tests.conftest import RECIPES, run_cli
from tests.s3server import moto_server

RECIPE = RECIPES / "tiny-topology-trn3.yaml"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    # in files of ~8 MiB: moto copies a whole object for each ranged GET (a 100 MB file made it 10x slower)
    return synthesize(preset("tiny-topology"), tmp_path_factory.mktemp("ck") / "topo-bf16", seed=0, dtype="bf16",
                      max_shard_bytes=8 << 20)


def _env(tmp_path) -> dict:
    env = {"GKBUILD_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
    for d in env.values():
        os.makedirs(d)
    return env


def _shards(manifest: dict) -> dict:
    return {f["path"]: f["sha256"] for f in manifest["files"] if f.get("role") != "artifact"}


@pytest.mark.slow
def test_a_dense_source_streamed_from_s3_builds_the_shards_of_the_folder_build(dense, tmp_path):
    rule = "floor"  # not the default: the recipe's rule reaches the streamed workers
    out = tmp_path / "build"
    r = run_cli("compile", str(RECIPE), "--set", f"source={dense}", "--set", f"quantize.scale_rule={rule}",
                "--out", str(out), "--no-compile", "-q", env=_env(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    folder = json.loads((out / "manifest.json").read_text())
    assert folder["source"]["layout"] == "bf16"
    assert folder["source"]["quantize"]["scale_rule"] == rule
    with moto_server() as url:  # the AWS chain points at it while it runs
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="src")
        for p in sorted(dense.iterdir()):
            client.upload_file(str(p), "src", f"ft/{p.name}")
        r = run_cli("compile", str(RECIPE), "--set", "source=s3://src/ft", "--set", f"quantize.scale_rule={rule}",
                    "--to", str(tmp_path / "store"), "--scratch-limit", "24MiB", "--no-compile", "-q",
                    env=_env(tmp_path / "b"))
        assert r.returncode == 0, r.stderr
    fetch(str(tmp_path / "store"), tmp_path / "got", quiet=True)
    manifest = json.loads((tmp_path / "got" / "manifest.json").read_text())
    assert _shards(manifest) == _shards(folder)
    assert manifest["source"]["kind"] == "s3" and manifest["source"]["quantize"] == folder["source"]["quantize"]
