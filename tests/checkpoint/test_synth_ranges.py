"""``synth://`` read by range (``synth_ranged.SynthRemote``): every byte of every file equals what
``gkbuild synth`` writes for the same preset, layers and seed - seeded random ranges and ranges
cut at the awkward places (inside an MX block or a bf16 element, across a chunk boundary, across
the header's end and between tensors), for every kind the generator makes; the 120b shape's
ranges equal chunks generated whole; a range builds nothing much bigger than itself. A streamed
build from it equals the one from the synthesized folder; bad queries fail in one line."""

import hashlib
import json
import tracemalloc
import zlib

import numpy as np
import pytest

from gkbuild.checkpoint import names, synth
from gkbuild.checkpoint.ranged import RangedCheckpoint, connect
from gkbuild.checkpoint.synth_ranged import SynthRemote
from gkbuild.errors import GkError
from gkbuild.model import preset
from gkbuild.publish import index
from tests.conftest import RECIPES, run_cli


def _kind(name: str) -> str:
    """The generator's branch a tensor takes."""
    if names.dense_expert(name):
        return "dense expert"
    for suffix in ("_blocks", "_scales", "bias", "sinks"):
        if name.endswith(suffix):
            return suffix.strip("_")
    if name.endswith("layernorm.weight") or name == names.FINAL_NORM:
        return "norm"
    return {names.EMBED: "embed", names.LM_HEAD: "lm_head"}.get(name, "bf16 weight")


KINDS = {"blocks", "scales", "bias", "sinks", "norm", "embed", "lm_head", "bf16 weight"}
DENSE_KINDS = KINDS - {"blocks", "scales"} | {"dense expert"}


def _awkward(remote: SynthRemote, name: str) -> list[tuple[int, int]]:
    """Ranges of a weight file cut where an addressing mistake would show: the header's end, each
    tensor's first and last bytes, inside an MX block (16 bytes) or a bf16 element, and across
    every chunk boundary of every tensor."""
    w = remote._weights[name]
    h = len(w.header)
    out = [(0, 8), (3, h + 5), (h - 1, h + 1)]
    for start, spec in zip(w.starts, w.specs):
        n = spec.nbytes
        out += [(start, start + min(n, 37)), (start + 1, start + min(n, 3)), (start + n - 7, start + n + 9),
                (start + 7, start + min(n, 16 * 3 + 5))]
        step = synth._step(spec) * (spec.nbytes // int(np.prod(spec.shape)))
        for b in range(step, n, step):
            out += [(start + b - 5, start + b + 11), (start + b - 1, start + b)]
    return [(max(0, a), min(b, w.size)) for a, b in out]


def _compare(remote: SynthRemote, folder, rng, count: int) -> set[str]:
    """Every file whole and by ``count`` random ranges plus the awkward ones; the kinds touched."""
    on_disk = {p.name for p in folder.iterdir()} - {"tokenizer.json", "tokenizer_config.json"}
    assert set(remote.files()) == on_disk
    kinds = set()
    for name, f in remote.files().items():
        data = (folder / name).read_bytes()
        assert f.size == len(data)
        assert bytes(remote.read(name, 0, f.size)) == data, name
        ranges = [(a, int(rng.integers(a, min(f.size, a + (1 << int(rng.integers(0, 20)))) + 1)))
                  for a in rng.integers(0, f.size, count).tolist()]
        if name in remote._weights:
            ranges += _awkward(remote, name)
        for a, b in ranges:
            assert bytes(remote.read(name, a, b - a)) == data[a:b], (name, a, b)
        if name in remote._weights:
            w = remote._weights[name]
            kinds |= {_kind(s.name) for s in w.specs}
    return kinds


@pytest.mark.parametrize("preset_name,layers,seed,dtype", [("tiny", 2, 0, "mxfp4"), ("tiny-topology", 2, 3, "mxfp4"),
                                                           ("tiny", 2, 0, "bf16"), ("tiny", 1, 2, "fp32")])
def test_random_ranges_equal_what_gkbuild_synth_writes(tmp_path, preset_name, layers, seed, dtype):
    r = run_cli("synth", preset_name, "--layers", str(layers), "--seed", str(seed), "--out", str(tmp_path / "ck"),
                "--dtype", dtype, "-q")
    assert r.returncode == 0, r.stderr
    query = f"layers={layers}&seed={seed}" + (f"&dtype={dtype}" if dtype != "mxfp4" else "")
    remote = connect(f"synth://{preset_name}?{query}")
    kinds = _compare(remote, tmp_path / "ck", np.random.default_rng(seed), 150)
    assert kinds == (KINDS if dtype == "mxfp4" else DENSE_KINDS)
    cfg = json.loads(bytes(remote.small("config.json", 1 << 20)))
    assert cfg["num_hidden_layers"] == layers and cfg["gkbuild_synth"]["seed"] == seed
    assert ("quantization_config" in cfg) == (dtype == "mxfp4")


def test_ranges_across_many_chunk_boundaries(tmp_path, monkeypatch):
    """Chunks of 4000 bytes (a multiple of neither 8 nor 16): most tensors span several, so every
    range above crosses boundaries inside MX blocks and bf16 words. The folder is what the first
    synth wrote with these chunks (its sha256, pinned before ranges existed)."""
    monkeypatch.setattr(synth, "CHUNK_BYTES", 4000)
    folder = synth.synthesize(preset("tiny-topology").with_layers(1), tmp_path / "ck", seed=5,
                              max_shard_bytes=3 << 20)
    digest = hashlib.sha256("".join(f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in
                                    sorted(folder.glob("model-*"))).encode()).hexdigest()
    assert digest == PINNED_4000
    monkeypatch.setattr(synth, "DEFAULT_MAX_SHARD", 3 << 20)  # the sharding this folder has
    remote = connect("synth://tiny-topology?layers=1&seed=5")
    assert len(remote._weights) > 1
    assert _compare(remote, folder, np.random.default_rng(1), 60) == KINDS


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dense_ranges_across_many_chunk_boundaries(tmp_path, monkeypatch, dtype):
    """The dense experts' specials (a hash of each element's MX block) and fp32's widening, cut at
    chunks of 100002 bytes (an odd number of bf16 elements): the ranges cross chunk boundaries
    inside MX blocks (32 elements down a column) and, for fp32, inside elements."""
    monkeypatch.setattr(synth, "CHUNK_BYTES", 100_002)
    folder = synth.synthesize(preset("tiny").with_layers(1), tmp_path / "ck", seed=5,
                              max_shard_bytes=3 << 20, dtype=dtype)
    monkeypatch.setattr(synth, "DEFAULT_MAX_SHARD", 3 << 20)
    remote = connect(f"synth://tiny?layers=1&seed=5&dtype={dtype}")
    assert len(remote._weights) > 1
    assert _compare(remote, folder, np.random.default_rng(2), 40) == DENSE_KINDS


# sha256 over "name sha256\n" of the weight files of tiny-topology, 1 layer, seed 5, 3 MiB shards,
# 4000-byte chunks, as synth.py wrote them at 583743f (before any range was generated alone)
PINNED_4000 = "b82e8c30edc427fc122f15addc2a2d80a6393d96766c53d677e0d73230922890"


def test_the_120b_shape_by_range_equals_chunks_generated_whole():
    """synth://gpt-oss-120b?layers=36: its headers validate as the real layout; a range across the
    embedding's first chunk boundary and one inside a layer-35 expert's MX blocks equal the same
    bytes cut from whole chunks drawn straight from the seed (PCG64DXSM seeded by seed, tensor
    crc32, chunk: the recipe synth documents)."""
    remote = connect("synth://gpt-oss-120b?layers=36&seed=7")
    ck = RangedCheckpoint.open_remote(remote)
    assert ck.config.L == 36 and sum(f.size for f in remote.files().values()) > 60e9

    def whole_chunk(name: str, chunk: int, nbytes: int) -> np.ndarray:
        bg = np.random.PCG64DXSM(np.random.SeedSequence([7, zlib.crc32(name.encode()), chunk]))
        return bg.random_raw((nbytes + 7) // 8).view(np.uint8)[:nbytes]

    emb = ck.info(names.EMBED)
    raw = np.concatenate([whole_chunk(names.EMBED, 0, synth.CHUNK_BYTES), whole_chunk(names.EMBED, 1, 64)])
    want = synth._bf16(raw, 1.0).view(np.uint8)[synth.CHUNK_BYTES - 33:synth.CHUNK_BYTES + 45]
    got = remote.read(emb.file.name, emb.offset + synth.CHUNK_BYTES - 33, 78)
    assert bytes(got) == want.tobytes()

    blocks = ck.info(names.layer_prefix(35) + "mlp.experts.down_proj_blocks")
    at = 5 * synth.CHUNK_BYTES + 123_457  # chunk 5, mid-block
    raw = whole_chunk(blocks.name, 5, synth.CHUNK_BYTES)
    tracemalloc.start()
    got = remote.read(blocks.file.name, blocks.offset + at, 1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert bytes(got) == raw[123_457:123_457 + (1 << 20)].tobytes()
    assert peak < 3 << 20, peak  # the range and its generator output, not its 16 MB chunk or the tensor


@pytest.mark.parametrize("query,what", [
    ("tiny?layers=0&seed=0", "layers"), ("tiny?layers=999999&seed=0", "layers"),
    ("nope?layers=2&seed=0", "unknown preset"), ("tiny?layers=2&seed=x", "integers"),
    ("tiny?layers=2&seed=-1", "seed"), ("tiny?layers=2&seed=0&colour=red", "unknown synth parameter"),
    ("tiny?layers=2&seed=0&dtype=fp8", "synth dtype")])
def test_a_bad_query_fails_in_one_line(tmp_path, query, what):
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--set", f"source=synth://{query}",
                "--to", str(tmp_path / "store"), "--no-compile", env={"GKBUILD_CACHE": str(tmp_path / "c")})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and what in lines[0], r.stderr
    assert not (tmp_path / "store").exists()
    with pytest.raises(GkError):
        SynthRemote(f"synth://{query}")


def test_a_bad_read_mode_fails_in_one_line(tmp_path):
    r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--to", str(tmp_path / "store"),
                "--no-compile", env={"GKBUILD_CACHE": str(tmp_path / "c"), "GKBUILD_SYNTH_READ": "sideways"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "GKBUILD_SYNTH_READ" in lines[0], r.stderr


def test_a_streamed_build_by_range_equals_the_one_from_the_synthesized_folder(tmp_path):
    """tiny-topology into a folder store, read by range (nothing synthesized: the cache holds no
    checkpoint) and from the synthesized folder: the same index and build id, the same blobs."""
    stores = {}
    for mode in ("range", "disk"):
        cache = tmp_path / f"cache-{mode}"
        r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--to", str(tmp_path / mode),
                    "--no-compile", "-q", "--json", env={"GKBUILD_CACHE": str(cache), "GKBUILD_SYNTH_READ": mode})
        assert r.returncode == 0, r.stderr
        assert (cache / "synth").exists() == (mode == "disk")
        stores[mode] = {p.relative_to(tmp_path / mode).as_posix(): p.read_bytes()
                        for p in (tmp_path / mode).rglob("*") if p.is_file()}
        out = json.loads(r.stdout)
        assert (out["stream"]["source_read"] > 0) == (mode == "range")
    idx = {m: json.loads(s[index.NAME]) for m, s in stores.items()}
    assert idx["range"]["build_id"] == idx["disk"]["build_id"]
    assert stores["range"] == stores["disk"]


def test_a_checkpoint_read_by_range_is_never_materialized(tmp_path, monkeypatch):
    from gkbuild.checkpoint.source import materialize, parse, synth_by_range

    monkeypatch.setenv("GKBUILD_CACHE", str(tmp_path))
    assert synth_by_range(parse("synth://gpt-oss-120b?layers=36&seed=0"))  # 61 GB: by range by default
    assert not synth_by_range(parse("synth://tiny?layers=2&seed=0"))
    monkeypatch.setenv("GKBUILD_SYNTH_READ", "range")
    with pytest.raises(GkError, match="read by range"):
        materialize(parse("synth://tiny?layers=2&seed=0"))
    assert not any(tmp_path.iterdir())


def test_the_golden_by_range_equals_the_golden_from_the_synthesized_folder(tmp_path):
    """``gkbuild golden synth://tiny...`` read by range (nothing synthesized) and from the folder:
    every tensor bit for bit and the metadata (the checkpoint's content hash included) equal. The
    files are compared by content: safetensors writes metadata keys in no fixed order."""
    from safetensors import safe_open

    got = {}
    for mode in ("range", "disk"):
        cache, out = tmp_path / f"cache-{mode}", tmp_path / f"{mode}.safetensors"
        r = run_cli("golden", "synth://tiny?layers=2&seed=0", "--out", str(out), "-q", "--steps", "2",
                    "--prompts", "2", env={"GKBUILD_CACHE": str(cache), "GKBUILD_SYNTH_READ": mode})
        assert r.returncode == 0, r.stderr
        assert (cache / "synth").exists() == (mode == "disk")
        with safe_open(str(out), "np") as f:
            got[mode] = (f.metadata(), {k: f.get_tensor(k) for k in f.keys()})
    (meta_r, t_r), (meta_d, t_d) = got["range"], got["disk"]
    assert meta_r == meta_d and json.loads(meta_r["meta"])["checkpoint_sha256"]
    assert t_r.keys() == t_d.keys() and all(t_r[k].tobytes() == t_d[k].tobytes() for k in t_r)


def test_a_build_by_range_equals_the_build_from_the_synthesized_folder(tmp_path):
    """``compile --out`` of tiny-topology read by range (its workers generate what they read;
    nothing synthesized) and from the folder: the same manifest (build id) and the same shards."""
    builds = {}
    for mode in ("range", "disk"):
        cache = tmp_path / f"cache-{mode}"
        r = run_cli("compile", str(RECIPES / "tiny-topology-trn3.yaml"), "--out", str(tmp_path / mode),
                    "--no-compile", "-q", env={"GKBUILD_CACHE": str(cache), "GKBUILD_SYNTH_READ": mode})
        assert r.returncode == 0, r.stderr
        assert (cache / "synth").exists() == (mode == "disk")
        builds[mode] = {p.relative_to(tmp_path / mode).as_posix(): p.read_bytes()
                        for p in (tmp_path / mode).rglob("*") if p.is_file() and ".gkbuild" not in p.parts}
    assert json.loads(builds["range"]["manifest.json"])["build_id"] == json.loads(builds["disk"]["manifest.json"])["build_id"]
    assert builds["range"] == builds["disk"]
