"""s3:// checkpoint sources against a real S3 server (moto on 127.0.0.1): a build from a bucket
equals the build from the same folder; files are verified against S3's ETags (single-part and
multipart) before they take their name; the local cache is reused until the object or the
cached file changes; a hostile index is refused."""

import json

import boto3
import pytest
from boto3.s3.transfer import TransferConfig

from gkbuild import recipe
from gkbuild.checkpoint import s3_source
from gkbuild.checkpoint.reader import INDEX
from gkbuild.errors import GkError
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from tests.conftest import RECIPES, run_cli

# every file above 5 MiB goes up multipart (5 MiB parts): both ETag forms are exercised
MULTIPART = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)


@pytest.fixture
def uploaded(tiny_ckpt, bucket, s3_server):
    client = boto3.client("s3", endpoint_url=s3_server)
    for p in sorted(tiny_ckpt.iterdir()):
        client.upload_file(str(p), bucket, f"ckpt/tiny/{p.name}", Config=MULTIPART)
    return f"s3://{bucket}/ckpt/tiny", client


def _build(uri, out, **kw):
    return compile_build(recipe.load(RECIPES / "tiny-cpu.yaml", [f"source={uri}"]), out=out, quiet=True,
                         compile=False, **kw)


def test_a_build_from_a_bucket_equals_the_build_from_the_folder(uploaded, tiny_ckpt, tmp_path, monkeypatch):
    uri, client = uploaded
    monkeypatch.setattr(s3_source, "RANGE", 1 << 20)  # several ranged GETs a file
    etags = [client.head_object(Bucket=uri.split("/")[2], Key=f"ckpt/tiny/{p.name}")["ETag"] for p in tiny_ckpt.iterdir()]
    assert any("-" in e for e in etags) and any("-" not in e for e in etags)
    a = _build(uri, tmp_path / "a")
    b = _build(str(tiny_ckpt), tmp_path / "b")
    assert a.manifest["source"]["kind"] == "s3" and a.manifest["source"]["uri"] == uri
    assert a.manifest["source"]["files"] == b.manifest["source"]["files"]
    assert [(f["path"], f["sha256"]) for f in a.manifest["files"]] == [(f["path"], f["sha256"]) for f in b.manifest["files"]]
    assert problems(tmp_path / "a") == []
    assert {s.name: s.status for s in a.stages}["resolve"] == "ran"

    def no_download(*a, **k):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(s3_source._Mirror, "_download", no_download)
    again = _build(uri, tmp_path / "c")
    assert {s.name: s.status for s in again.stages}["resolve"] == "cached"
    assert again.manifest["build_id"] == a.manifest["build_id"]


def test_a_changed_object_or_cached_file_is_read_again(uploaded, tiny_ckpt, tmp_path, monkeypatch):
    uri, client = uploaded
    _build(uri, tmp_path / "a")
    local = s3_source.cache_dir(s3_source.s3.parse(uri))
    got = []
    real = s3_source._Mirror._download
    monkeypatch.setattr(s3_source._Mirror, "_download", lambda self, name, *a: (got.append(name), real(self, name, *a)))
    (local / INDEX).write_text((local / INDEX).read_text() + " ")  # edited in the cache
    changed = (tiny_ckpt / "config.json").read_bytes() + b"\n"
    client.put_object(Bucket=uri.split("/")[2], Key="ckpt/tiny/config.json", Body=changed)  # a new object
    s3_source.resolve(uri)
    assert sorted(got) == sorted(["config.json", INDEX])
    assert (local / "config.json").read_bytes() == changed
    assert (local / INDEX).read_bytes() == (tiny_ckpt / INDEX).read_bytes()


def test_bytes_that_do_not_match_the_etag_never_take_their_name(uploaded, tmp_path, monkeypatch):
    uri, _ = uploaded
    real = s3_source._Mirror._download

    def corrupted_in_transit(self, name, obj, tmp, advance):
        real(self, name, obj, tmp, advance)
        if name.endswith(".safetensors"):
            with open(tmp, "r+b") as f:
                f.seek(obj["size"] // 2)
                b = f.read(1)
                f.seek(obj["size"] // 2)
                f.write(bytes([b[0] ^ 1]))

    monkeypatch.setattr(s3_source._Mirror, "_download", corrupted_in_transit)
    with pytest.raises(GkError, match="do not match S3's ETag"):
        _build(uri, tmp_path / "a")
    local = s3_source.cache_dir(s3_source.s3.parse(uri))
    assert not list(local.glob("*.safetensors")) and not list(local.glob(".*partial"))


def test_a_hostile_or_incomplete_bucket_is_one_clear_line(bucket, s3_server, tiny_ckpt, tmp_path):
    client = boto3.client("s3", endpoint_url=s3_server)
    with pytest.raises(GkError, match="no config.json in the bucket"):
        _build(f"s3://{bucket}/empty", tmp_path / "a")
    client.upload_file(str(tiny_ckpt / "config.json"), bucket, "evil/config.json")
    client.put_object(Bucket=bucket, Key=f"evil/{INDEX}", Body=json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(GkError, match="names weight files outside the prefix"):
        _build(f"s3://{bucket}/evil", tmp_path / "a")
    with pytest.raises(GkError, match="the bucket does not exist"):
        _build("s3://no-such-bucket-at-all/x", tmp_path / "a")
    with pytest.raises(GkError, match="expected s3://BUCKET"):
        _build("s3://bucket/../x", tmp_path / "a")


def test_plan_reads_only_the_config(uploaded, tmp_path):
    uri, _ = uploaded
    r = tmp_path / "r.yaml"
    r.write_text((RECIPES / "tiny-cpu.yaml").read_text().replace("source: synth://tiny?layers=2&seed=0", f"source: {uri}"))
    assert f"source: {uri}" in r.read_text()
    res = run_cli("plan", str(r), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["files"]
    local = s3_source.cache_dir(s3_source.s3.parse(uri))
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["config.json"]


def test_text_prompts_take_the_tokenizer_files_from_the_bucket_alone(uploaded):
    """An s3:// source's tokenizer comes with its two small files, not the weights."""
    from gkbuild import text
    from gkbuild.checkpoint.source import parse

    uri, _ = uploaded
    spec = parse(uri)
    assert text.local_tokenizer(spec) is None  # nothing fetched yet, and none asked for
    tok = text.tokenizer(spec)
    assert text.encode(tok, ["Once upon a time"], chat=True)[0][0] == tok.convert_tokens_to_ids("<|start|>")
    folder = text.folder(spec)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["tokenizer.json",
                                                                                     "tokenizer_config.json"]
    assert text.local_tokenizer(spec) is not None  # now in the local mirror
