"""Help that teaches: every command (subcommands of groups too) has a one-line summary and examples
that parse against the command they name, every option sits in one of the same sections on every
command, and `gkbuild` with no arguments lists the commands by task."""

import shlex

import click
import pytest

from gkbuild import cli_help
from gkbuild.cli import cli
from tests.conftest import run_cli


def _commands(group=cli, path=("gkbuild",)):
    yield path, group
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


COMMANDS = list(_commands())
IDS = [" ".join(p) for p, _ in COMMANDS]


def _example_lines(cmd) -> list[str]:
    """The examples as shell lines: continuations joined, comments and redirections cut."""
    lines, cur = [], ""
    for line in cmd.examples:
        cur += line.strip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        lines.append(cur.split(" #")[0].split(" > ")[0].strip())
        cur = ""
    assert not cur, f"{cmd.name}: an example ends in a continuation"
    return lines


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=IDS)
def test_every_command_has_a_one_line_summary_and_examples_that_parse(path, cmd):
    assert isinstance(cmd, cli_help.Command), f"{' '.join(path)} is not a cli_help.Command"
    assert cmd.summary and "\n" not in cmd.summary and len(cmd.summary) <= 100 and cmd.summary.endswith("."), \
        f"{' '.join(path)}: the docstring's first line must be a one-line summary: {cmd.summary!r}"
    assert cmd.get_short_help_str(200) == cmd.summary
    assert cmd.examples, f"{' '.join(path)}: no Examples: paragraph in its docstring"
    named = 0
    for line in _example_lines(cmd):
        args = shlex.split(line)
        assert args[0] == "gkbuild", line
        target, args = cli, args[1:]
        while isinstance(target, click.Group) and args and args[0] in target.commands:
            target, args = target.commands[args[0]], args[1:]
        named += target is cmd or (isinstance(cmd, click.Group) and target in cmd.commands.values())
        assert not isinstance(target, click.Group), f"{line}: names no command"
        target.make_context(target.name, list(args))  # its options and arguments exist and parse; nothing runs
    assert named, f"{' '.join(path)}: no example runs this command (or one of its subcommands)"


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=IDS)
def test_options_are_in_the_same_sections_on_every_command(path, cmd):
    ctx = click.Context(cmd, info_name=path[-1])
    text = cmd.get_help(ctx)
    shown = [s for s in (*cli_help.SECTIONS, "Other") if f"\n{s} options:\n" in text or f"\n{s}:\n" in text]
    assert shown == sorted(shown, key=(*cli_help.SECTIONS, "Other").index)  # always in one order
    for p in cmd.get_params(ctx):
        if isinstance(p, click.Option):
            section = cli_help.section_of(p)  # raises for an option the table does not place
            assert section in (*cli_help.SECTIONS, "Other")
            head = f"\n{section} options:\n" if section != "Other" else "\nOther:\n"
            block = text[text.index(head):]
            block = block[:block.find("\n\n", 1) + 1 or None]
            assert max(p.opts, key=len) in block, f"{' '.join(path)}: {p.opts} not under {section}"
    if cmd.examples:
        assert text.rstrip().endswith(cmd.examples[-1].rstrip())  # the examples end the help


def test_every_root_command_is_in_a_task():
    placed = [n for names in cli_help.TASKS.values() for n in names]
    assert sorted(placed) == sorted(cli.commands), (
        "every command is in exactly one task of gkbuild/cli_help.py TASKS: "
        f"missing {sorted(set(cli.commands) - set(placed))}, unknown {sorted(set(placed) - set(cli.commands))}")
    assert len(placed) == len(set(placed))


def test_gkbuild_with_no_arguments_shows_the_commands_by_task():
    r = run_cli()
    assert r.returncode == 0, r.stderr
    at = [r.stdout.index(f"\n{task}:\n") for task in cli_help.TASKS]
    assert at == sorted(at)
    for task, names in cli_help.TASKS.items():
        block = r.stdout[r.stdout.index(f"\n{task}:\n"):].split("\n\n")[0]
        for n in names:
            assert f"\n  {n} " in block, (task, n)
    assert "Examples:\n  gkbuild synth tiny" in r.stdout


def test_a_subgroup_with_no_arguments_shows_its_help():
    r = run_cli("cache")
    assert r.returncode == 0 and "Commands:" in r.stdout and "prune" in r.stdout
