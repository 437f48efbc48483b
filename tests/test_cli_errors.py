"""A full disk, a read-only file system, a folder where a file should be: one line, exit 1, and
nothing half-written."""

import errno
import os

import pytest

from gkbuild import cli
from tests.conftest import RECIPES


@pytest.mark.parametrize("code, text", [(errno.ENOSPC, "No space left on device"),
                                        (errno.EROFS, "Read-only file system")])
def test_a_failing_disk_is_one_line(tmp_path, monkeypatch, capsys, code, text):
    real = os.replace

    def failing(src, dst, *a, **k):
        if str(dst).endswith(".safetensors"):
            raise OSError(code, os.strerror(code), str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", failing)
    out, err = _failed_build(tmp_path, capsys)
    assert err.startswith("gkbuild: error: ") and err.strip().endswith(f".safetensors: {text}")


def _failed_build(tmp_path, capsys) -> tuple:
    """Build the tiny model where the disk fails: exit 1, one line and no traceback, no manifest,
    no partial file (the writer removed its temporary); (the build folder, that line)."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        cli.main(["compile", str(RECIPES / "tiny-cpu.yaml"), "--out", str(out), "-q", "--no-compile", "-j", "1"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.rglob("*.partial")]
    return out, err


def test_a_disk_that_fills_mid_shard_is_one_line_naming_the_shard(tmp_path, monkeypatch, capsys):
    """A write of a shard's bytes fails (the OSError of a write names no file): the line names the shard."""
    real = os.pwrite

    def full(fd, buf, pos):
        if "/weights/expert-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, pos)

    monkeypatch.setattr(os, "pwrite", full)
    out, err = _failed_build(tmp_path, capsys)
    assert err.startswith(f"gkbuild: error: {out}/weights/expert-") and \
        err.strip().endswith(".safetensors: No space left on device")


def test_out_naming_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit):
        cli.main(["compile", str(RECIPES / "tiny-cpu.yaml"), "--out", str(tmp_path / "f"), "-q"])
    assert "f: exists and is not a folder" in capsys.readouterr().err
    assert (tmp_path / "f").read_text() == "x"
