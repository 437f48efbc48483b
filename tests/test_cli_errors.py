"""A full disk, a read-only file system, a folder where a file should be: one line, exit 1, and
nothing half-written."""

import errno
import os
import re

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


ANSI = "\x1b[2J\x1b]0;owned\x07\x9b31m\u202e"  # clear screen, set the title, a C1 CSI, a bidi override


def test_a_peers_error_text_reaches_the_terminal_escaped(monkeypatch, capsys, tmp_path):
    """A fake prefill peer (its own process on 127.0.0.1) answers with an error whose text holds
    terminal escapes: the line gkbuild prints shows them, it does not send them."""
    import click

    from gkbuild.di.decode import Peer
    from tests.di.fake_prefill import frame, scripted

    @click.group()
    def group():
        pass

    @group.command()
    def connect():
        Peer(endpoint, timeout=5)

    monkeypatch.setattr(cli, "cli", group)  # main() prints what the command raised, as for any command
    with scripted(tmp_path, [frame({"op": "error", "message": f"prefill: {ANSI}boom"})]) as (endpoint, _):
        with pytest.raises(SystemExit) as e:
            cli.main(["connect"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "boom" in err
    assert not any(c in err for c in "\x1b\x07\x9b\u202e")
    assert "\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e" in err


def test_a_file_name_and_a_warning_reach_the_terminal_escaped(build, capsys):
    """check prints the names of files it finds; a warning quotes a store's or a file's text."""
    from gkbuild.progress import warn

    (build / f"x{ANSI}y").write_text("planted")
    with pytest.raises(SystemExit):
        cli.main(["check", str(build), "-q"])
    out = capsys.readouterr()
    assert "extra: x\\x1b[2J" in out.out and not any(c in out.out + out.err for c in "\x1b\x07\x9b\u202e")
    warn(f"a store said {ANSI}[bold]hi[/bold]")
    err = capsys.readouterr().err
    assert "\\x1b[2J" in err and "[bold]hi[/bold]" in err and "\x1b[2J" not in err


def test_a_file_given_as_the_compile_cache_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "cache.txt").write_text("not a store")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        cli.main(["compile", str(RECIPES / "tiny-cpu.yaml"), "--out", str(out), "-q", "--cache",
                  str(tmp_path / "cache.txt")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert "cache.txt: exists and is not a folder, so not a store" in err
    assert not out.exists() and (tmp_path / "cache.txt").read_text() == "not a store"


@pytest.mark.parametrize("command", ["publish", "fetch"])
def test_a_full_disk_in_publish_and_fetch_names_the_file(built, tmp_path, monkeypatch, capsys, command):
    """The store (publish) or the folder fetched into (fetch) fills while a file is written: the
    OSError of a write names no file; the line does."""
    store, dest = tmp_path / "store", tmp_path / "dest"
    if command == "fetch":
        cli.main(["publish", str(built), "--to", str(store), "-q"])
    real = os.fsync

    def full(fd):
        where = os.readlink(f"/proc/self/fd/{fd}")
        if "/weights/" in where or (command == "publish" and "/blobs/" in where) or \
                (command == "fetch" and "/.gkbuild/fetch/" in where):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main([command, *((str(built), "--to", str(store)) if command == "publish" else (str(store), "--to",
                                                                                          str(dest))), "-q", "-j", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    named = f"{store}/blobs/" if command == "publish" else f"{dest}/"
    assert err.startswith(f"gkbuild: error: {named}") and err.strip().endswith(": No space left on device")


LOOP = "LOOP"  # a symlink to itself, given where each command takes a path
PATH_OPTIONS = [
    ["compile", "R", "--host-profile", LOOP, "-q"], ["compile", "R", "--out", LOOP, "-q", "--no-compile"],
    ["compile", "R", "--to", LOOP, "-q", "--no-compile"], ["compile", LOOP, "-q"], ["compile", "SRC", "-q", "--no-compile"],
    ["compile", "R", "--out", f"{LOOP}/b", "-q", "--no-compile"], ["plan", LOOP], ["plan", "SRC"],
    ["inspect", LOOP], ["check", LOOP, "-q"], ["synth", "tiny", "--out", LOOP, "-q"],
    ["publish", LOOP, "--to", "S", "-q"], ["publish", "B", "--to", LOOP, "-q"], ["publish", "B", "--to", "S", "--sign", LOOP, "-q"],
    ["fetch", LOOP, "--to", "D", "-q"], ["fetch", "S", "--to", LOOP, "-q"], ["fetch", "S", "--to", f"{LOOP}/d", "-q"],
    ["verify", LOOP, "-q"], ["verify", "B", "--golden", LOOP, "-q"], ["verify", "B", "--report", LOOP, "-q", "--steps", "1"],
    ["verify-signature", LOOP, "--trust", LOOP], ["diff", LOOP, "B"], ["leases", LOOP], ["leases", LOOP, "--clear", f"leases/{'0' * 32}.json"],
    ["cache", "ls", LOOP], ["cache", "push", LOOP, "B"], ["cache", "push", "S", LOOP], ["cache", "prune", "S", "--keep", LOOP],
    ["di", "plan", LOOP], ["doctor", "--report", LOOP], ["farm", LOOP, "--cache", "S", "--list"],
    ["golden", LOOP, "--out", "g", "-q"], ["golden", "synth://tiny", "--out", LOOP, "-q", "--steps", "0"],
]

# Where another one line comes first, rightly: a build with nothing compiled to push; doctor without the SDK.
OTHER_FIRST = [["cache", "push", LOOP, "B"], ["doctor", "--report", LOOP]]


@pytest.mark.parametrize("args", PATH_OPTIONS, ids=[" ".join(a) for a in PATH_OPTIONS])
def test_a_symlink_loop_as_any_path_is_one_line(args, built, tmp_path, monkeypatch, capsys):
    """Every path a command takes, given as a symlink loop (or through one): one line, rc 1, nothing
    written, never a traceback (Path.resolve raises RuntimeError on a loop; stat, OSError)."""
    from gkbuild.publish.publish import publish

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    store = tmp_path / "store"
    publish(built, str(store), quiet=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text((RECIPES / "tiny-cpu.yaml").read_text() + f"\noutput: {tmp_path / 'out'}\n")
    src = tmp_path / "src.yaml"
    src.write_text(re.sub(r"(?m)^source: .*$", f"source: {loop}", (RECIPES / "tiny-cpu.yaml").read_text())
                   + f"\noutput: {tmp_path / 'out'}\n")
    assert f"source: {loop}" in src.read_text()
    names = {LOOP: str(loop), "R": str(recipe), "SRC": str(src), "S": str(store), "B": str(built), "D": str(tmp_path / "d")}
    argv = [a.replace(LOOP, str(loop)) if a.startswith(LOOP) else names.get(a, a) for a in args]
    monkeypatch.setenv("GKBUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("gkbuild: error:")]
    assert e.value.code == 1 and len(lines) == 1, err
    if args not in OTHER_FIRST:
        assert "loop" in lines[0] or "Too many levels of symbolic links" in lines[0] or "link" in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "d").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == [n for n in before if n != "cache"]


def test_golden_never_overwrites_a_file_it_did_not_write(tmp_path, capsys):
    """--out at someone's file: refused before the golden is computed, the file untouched; a golden
    gkbuild wrote is replaced."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    with pytest.raises(SystemExit) as e:
        cli.main(["golden", "synth://tiny", "--out", str(mine), "-q", "--steps", "1", "--prompts", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "is not a gkbuild golden" in err, err
    assert mine.read_text() == "mine"
    g = tmp_path / "g.safetensors"
    for _ in range(2):
        cli.main(["golden", "synth://tiny", "--out", str(g), "-q", "--steps", "1", "--prompts", "1"])
    assert g.stat().st_size > 0 and sorted(p.name for p in tmp_path.iterdir()) == ["g.safetensors", "notes.txt"]


@pytest.mark.parametrize("command", [["leases"], ["cache", "ls"]])
def test_a_store_that_is_not_there_is_said_so(command, tmp_path, capsys):
    """`leases` of a missing store used to say "no leases", rc 0; `cache ls`, 0 programs."""
    with pytest.raises(SystemExit) as e:
        cli.main([*command, str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "no store there" in err, err
