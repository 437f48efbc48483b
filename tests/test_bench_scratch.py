"""bench/_measure.scratch: a bench's --dir never costs the user a file the bench did not write."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _measure import MARK, scratch  # noqa: E402


@pytest.fixture(autouse=True)
def _cache_env(monkeypatch):
    monkeypatch.delenv("GKBUILD_CACHE", raising=False)  # scratch sets it: undone after each test


def test_foreign_folder_refused_and_left_intact(tmp_path):
    mine = tmp_path / "data"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "sub" / "x.bin").write_bytes(b"\0\1")
    with pytest.raises(SystemExit) as e:
        with scratch(mine):
            pytest.fail("the body ran on a foreign folder")
    assert e.value.code != 0 and "not empty" in str(e.value.code) and "\n" not in str(e.value.code)
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == ["notes.txt", "sub", "sub/x.bin"]
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub" / "x.bin").read_bytes() == b"\0\1"
    assert "GKBUILD_CACHE" not in os.environ


def test_a_file_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(SystemExit):
        with scratch(f):
            pass
    assert f.read_text() == "x"


def test_made_marked_emptied_and_removed(tmp_path):
    d = tmp_path / "new" / "scratch"
    with scratch(d) as got:
        assert got == d and (d / MARK).is_file()
        assert os.environ["GKBUILD_CACHE"] == str(d / "cache")
        (d / "out").mkdir()
        (d / "out" / "a").write_text("bench's")
    assert not d.exists()
    with scratch(d, remove=False):  # kept: the next run empties it, as it carries the marker
        (d / "left").write_text("from run 1")
    with scratch(d, resume=True):
        assert (d / "left").exists()
    assert not d.exists()
    with scratch(d, remove=False):
        (d / "left").write_text("from run 1")
    with scratch(d, remove=False):
        assert sorted(p.name for p in d.iterdir()) == [MARK]


def test_users_empty_folder_is_used_and_left(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with scratch(d, cache=None):
        assert "GKBUILD_CACHE" not in os.environ
        (d / "x").write_text("bench's")
    assert d.is_dir() and not any(d.iterdir())


def test_no_cleanup_after_an_error(tmp_path):
    d = tmp_path / "s"
    with pytest.raises(RuntimeError):
        with scratch(d):
            (d / "partial").write_text("look at me")
            raise RuntimeError
    assert (d / "partial").exists()  # a failed run's files stay, to look at (or resume)
