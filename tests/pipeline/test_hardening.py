"""compile against careless operators and hostile state: ownership of the output folder, atomic
rebuilds (killed at random moments), state files that lie, leftovers of killed runs."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from gkbuild import recipe
from gkbuild.pipeline import manifest as mf
from gkbuild.pipeline.check import problems
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.runtime import Build
from tests.conftest import RECIPES, run_cli

TINY = str(RECIPES / "tiny-cpu.yaml")


def _compile(out, *extra):
    return run_cli("compile", TINY, "--out", str(out), "--no-compile", "-q", "-j", "1", *extra)


def test_a_folder_that_is_not_a_build_is_refused_and_left_untouched(tmp_path):
    d = tmp_path / "mine"
    files = {"notes.txt": b"n", "manifest.json": b"{}", "layout/kv.json": b"k", "weights/shared.safetensors": b"s",
             "weights/thesis.partial": b"thesis"}
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    r = _compile(d)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"gkbuild: error: {d}: not empty and not a gkbuild build (holds 'layout'); build "
                                f"into a new or empty folder, or remove it")
    assert {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()} == files


def test_the_root_and_a_file_are_refused(tmp_path):
    r = _compile("/")
    assert r.returncode == 1 and "refusing to build into the file system root" in r.stderr
    (tmp_path / "f").write_text("x")
    r = _compile(tmp_path / "f")
    assert r.returncode == 1 and r.stderr.strip().endswith("f: exists and is not a folder; give a new, empty or "
                                                           "build folder as the output")
    assert (tmp_path / "f").read_text() == "x"


def test_output_inside_the_source_checkpoint_is_refused(tiny_copy, tmp_path):
    (tmp_path / "r.yaml").write_text(f"source: {tiny_copy}\ntarget: cpu\nkv_cache: {{num_blocks: 8}}\n")
    before = sorted(p.name for p in tiny_copy.iterdir())
    r = run_cli("compile", str(tmp_path / "r.yaml"), "--out", str(tiny_copy / "out"), "-q", "--no-compile")
    assert r.returncode == 1 and "the output folder and the source checkpoint" in r.stderr
    assert sorted(p.name for p in tiny_copy.iterdir()) == before


def test_a_state_file_naming_a_path_outside_is_set_aside_never_followed(build, tmp_path):
    victim = build.parent / "victim.txt"
    victim.write_text("keep me")
    state = build / ".gkbuild" / "state.json"
    s = json.loads(state.read_text())
    s["shards"]["../victim.txt"] = {"key": "k", "size": 7, "sha256": "0" * 64}
    state.write_text(json.dumps(s))
    r = _compile(build)
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "keep me"
    assert "would escape the build folder" in r.stderr and "state.json.corrupt-0" in r.stderr
    assert (build / ".gkbuild" / "state.json.corrupt-0").exists()
    assert problems(build) == []


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"shards": {"w": 3}}', b"\xff\xfe"])
def test_a_corrupt_state_or_fingerprint_file_never_blocks_a_build(build, tmp_path, content):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fingerprints.json").write_bytes(content)
    (build / ".gkbuild" / "state.json").write_bytes(content)
    r = run_cli("compile", TINY, "--out", str(build), "--no-compile", "-q",
                env={"GKBUILD_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert "set aside as state.json.corrupt-0" in r.stderr and "set aside as fingerprints.json.corrupt-0" in r.stderr
    assert (build / ".gkbuild" / "state.json.corrupt-0").read_bytes() == content
    assert json.loads((cache / "fingerprints.json").read_text())  # rewritten, valid
    assert problems(build) == []


def test_stale_temporaries_of_a_killed_run_are_removed_and_check_passes(build):
    stale = [build / "weights" / "shared.safetensors.4242.1.partial", build / "layout" / ".kv.json.4242.partial",
             build / ".manifest.json.4242.partial", build / "compiled" / ".tmp-compile-4242" / "x"]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("torn")
    (build / "weights" / "thesis.partial").write_text("not ours")
    compile_build(recipe.load(TINY), out=build, quiet=True, compile=False)
    assert not any(p.exists() for p in stale) and not (build / "compiled" / ".tmp-compile-4242").exists()
    assert (build / "weights" / "thesis.partial").read_text() == "not ours"  # not a name gkbuild writes
    assert problems(build) == ["extra: weights/thesis.partial is not in the manifest"]


def test_a_rebuild_removes_the_manifest_before_it_changes_a_byte(build, monkeypatch):
    """The old manifest never stands over new shards: gone before the first shard is rewritten."""
    from gkbuild.pipeline import pipeline

    seen = []
    real = pipeline._Build.shards

    def spy(self):
        seen.append((build / mf.NAME).exists())
        real(self)
        seen.append((build / mf.NAME).exists())

    monkeypatch.setattr(pipeline._Build, "shards", spy)
    r = recipe.load(TINY, ["kv_cache.dtype=fp8", "kv_cache.v_scale=2.0"])
    compile_build(r, out=build, quiet=True, compile=False)
    assert seen == [True, False]
    assert problems(build) == []


@pytest.mark.slow
def test_an_in_place_rebuild_killed_at_random_moments_is_never_half_whole(build, tmp_path):
    """kill -9 at 10 moments of a rebuild that changes kv_cache.v_scale (W_out's bytes): the folder
    has either no manifest, or one every file matches; a rerun always finishes intact."""
    rng = random.Random(11)
    env = dict(os.environ, GKBUILD_SYNC_INTERVAL="0")

    def command(scale):
        return [sys.executable, "-m", "gkbuild", "compile", TINY, "--out", str(build), "--no-compile", "-q", "-j",
                "1", "--set", "kv_cache.dtype=fp8", "--set", f"kv_cache.v_scale={scale}"]

    t0 = time.monotonic()  # how long a rebuild takes on this machine now: the kills spread over it
    assert subprocess.run(command("1.5"), env=env, capture_output=True).returncode == 0
    took = time.monotonic() - t0
    landed = 0
    for i in range(10):
        scale = f"{2.0 + i}"
        cmd = command(scale)
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(took * (0.05 + 0.09 * (i + rng.random())))
        landed += p.poll() is None
        p.send_signal(signal.SIGKILL)
        p.wait()
        if (build / mf.NAME).exists():
            assert problems(build) == [], f"kill {i}: a manifest over files that do not match it"
            b = Build.open(build, verify="hash")
            assert b.manifest["recipe"]["resolved"]["kv_cache"]["v_scale"] in (float(scale), float(scale) - 1, 1.5)
            b.load_rank(0)
            b.close()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert problems(build) == []
        assert json.loads((build / mf.NAME).read_text())["recipe"]["resolved"]["kv_cache"]["v_scale"] == float(scale)
    assert landed >= 5, f"only {landed} of 10 kills landed while the rebuild ran"


def test_concurrent_builds_on_a_fresh_cache_synthesize_once(tmp_path):
    """Two builds of a synth:// source start together on an empty $GKBUILD_CACHE: one
    synthesizes, the other waits and reuses it; neither deletes the other's checkpoint."""
    env = {"GKBUILD_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-m", "gkbuild", "compile", TINY, "--out", str(tmp_path / f"o{i}"),
                               "--no-compile", "-q", "-j", "1"], env=dict(os.environ, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    a, b = ((tmp_path / f"o{i}" / mf.NAME).read_bytes() for i in range(2))
    assert a == b
    assert len(list((tmp_path / "cache" / "synth").glob("tiny-*[!k]"))) == 1


def test_the_build_id_does_not_depend_on_mtimes_caches_or_paths(tiny_ckpt, tmp_path):
    """The same source bytes, copied elsewhere with new mtimes, built on a fresh $GKBUILD_CACHE:
    the same manifest (stage keys hash content, never mtimes or paths)."""
    manifests = []
    for i in (1, 2):
        src = tmp_path / f"h{i}" / "ck"
        shutil.copytree(tiny_ckpt, src)
        for p in src.iterdir():
            os.utime(p, ns=(i * 10**18, i * 10**18))
        (src.parent / "r.yaml").write_text("source: ck\ntarget: cpu\nkv_cache: {num_blocks: 8}\n")
        r = run_cli("compile", str(src.parent / "r.yaml"), "--out", str(src.parent / "out"), "--no-compile", "-q",
                    env={"GKBUILD_CACHE": str(src.parent / "cache")})
        assert r.returncode == 0, r.stderr
        manifests.append((src.parent / "out" / mf.NAME).read_bytes())
    assert manifests[0] == manifests[1]


def test_a_manifest_is_strict_json_both_ways(build):
    from gkbuild.errors import GkError

    with pytest.raises(GkError, match="refusing to write non-finite JSON"):
        mf.canonical({"x": float("nan")})
    text = (build / mf.NAME).read_text().replace('"eps": ', '"eps": NaN, "_": ', 1)
    (build / mf.NAME).write_text(text)
    with pytest.raises(GkError, match=r"manifest.json: not valid JSON \(NaN is not strict JSON\)"):
        mf.load(build)


def test_a_killed_cache_restores_temporary_is_not_reported_by_check_and_goes_with_the_next_compile(build):
    stale = build / "compiled" / ".decode.pt2.4242.cache.partial"  # a compile-cache restore killed midway
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("torn")
    assert problems(build) == []  # gkbuild's own temporary, not a file of the build
    compile_build(recipe.load(TINY), out=build, quiet=True, compile=False)
    assert not stale.exists() and problems(build) == []
