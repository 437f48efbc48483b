"""How ``gkbuild --help`` teaches: a one-line summary, the options in the same four sections on every
command (source, output, execution, trust), an Examples section, and the root's commands by task.

A command's docstring is its help: the first line is the summary, and a paragraph ``Examples:``
ends it, one command a line. The same text is what the documentation site's command reference
(mkdocs-click, which reads ``Command.help``) renders, the examples as a code block.
"""

from __future__ import annotations

import inspect
import re
import textwrap

import click

# Every option of every command sits in one section, by its long flag: the same flag lands in the
# same section on every command. tests/test_cli_help.py holds every command's options to this table.
SECTIONS = ("Source", "Output", "Execution", "Trust")
SECTION_OF = {
    # what a command reads: recipe values, prompts, the reference's inputs
    "--set": "Source", "--vary": "Source", "--layers": "Source", "--seed": "Source", "--golden": "Source",
    "--prompt": "Source", "--chat": "Source", "--prompt-ids": "Source", "--prompts": "Source",
    "--prompt-len": "Source", "--continuation": "Source", "--continuation-ids": "Source", "--forced": "Source",
    "--steps": "Source", "--kv": "Source", "--k-scale": "Source", "--v-scale": "Source",
    "--host-profile": "Source", "--target": "Source", "--kernels": "Source",
    # what it writes or prints, and where
    "--out": "Output", "--to": "Output", "--max-shard-size": "Output", "--level": "Output", "--report": "Output",
    "--json": "Output", "--quiet": "Output", "--show-compile": "Output", "--list": "Output", "--matrix": "Output",
    "--cache-push": "Output", "--dtype": "Output", "--scale-rule": "Output",
    # how it runs
    "--jobs": "Execution", "--force": "Execution", "--no-compile": "Execution", "--cache": "Execution",
    "--scratch-limit": "Execution", "--executor": "Execution", "--retries": "Execution", "--only": "Execution",
    "--engine": "Execution", "--device": "Execution", "--prefill": "Execution", "--prefill-tp": "Execution",
    "--transfer-timeout": "Execution", "--deep": "Execution", "--prune": "Execution", "--keep": "Execution",
    "--clear": "Execution",
    # what it accepts, signs or insists on
    "--sign": "Trust", "--trust": "Trust", "--trust-issuer": "Trust", "--expect": "Trust", "--require-neff": "Trust",
    "--loose": "Trust", "--allow-other-checkpoint": "Trust", "--quant-tolerance": "Trust",
    # click's own
    "--help": "Other", "--version": "Other",
}

# The root's commands by task, in the order a newcomer meets them.
TASKS = {
    "Start here": ["synth", "inspect", "quantize", "plan", "recipe-doc"],
    "Build": ["compile", "farm", "cache"],
    "Verify": ["verify", "golden", "check", "diff", "verify-signature"],
    "Publish and fetch": ["publish", "fetch", "leases"],
    "On a Trainium host, serving": ["doctor", "di"],
}

_EXAMPLES = re.compile(r"^Examples?:\s*$", re.M)


def split_help(text: str | None) -> tuple[str, list[str]]:
    """(description, example lines) of a command's docstring; no Examples paragraph: no examples."""
    text = inspect.cleandoc(text or "")
    m = _EXAMPLES.search(text)
    if not m:
        return text, []
    body = textwrap.dedent("\n".join(line for line in text[m.end():].splitlines() if line.strip() not in ("", "\b")))
    return text[:m.start()].rstrip(), body.splitlines()


def section_of(param: click.Parameter) -> str:
    """The help section of an option, by its longest flag (``-q`` and ``--quiet`` are one option)."""
    flag = max(param.opts, key=len)
    try:
        return SECTION_OF[flag]
    except KeyError:
        raise KeyError(f"option {flag} has no help section: add it to gkbuild/cli_help.py SECTION_OF") from None


class Command(click.Command):
    """A command whose help is summary, description, options by section, then examples."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        desc, self.examples = split_help(self.help)
        self.summary = desc.split("\n\n", 1)[0].strip()
        if self.short_help is None and "\n" not in self.summary:
            self.short_help = self.summary
        if self.examples:  # the docs render help as Markdown: the examples become a code block
            self.help = desc + "\n\nExamples:\n\n" + "\n".join("    " + e for e in self.examples)

    def format_help_text(self, ctx, formatter):
        desc, _ = split_help(self.help)
        if desc:
            formatter.write_paragraph()
            with formatter.indentation():
                formatter.write_text(desc)

    def format_options(self, ctx, formatter):
        rows: dict[str, list] = {}
        for p in self.get_params(ctx):
            rec = p.get_help_record(ctx)
            if rec is not None and isinstance(p, click.Option):
                rows.setdefault(section_of(p), []).append(rec)
        for name in (*SECTIONS, "Other"):
            if rows.get(name):
                with formatter.section(f"{name} options" if name != "Other" else "Other"):
                    formatter.write_dl(rows[name])

    def format_epilog(self, ctx, formatter):
        if self.examples:
            with formatter.section("Examples"):
                for e in self.examples:
                    formatter.write(f"{'':>{formatter.current_indent}}{e}\n")
        super().format_epilog(ctx, formatter)


class Group(Command, click.Group):
    """A group whose commands are help-teaching too; no arguments shows the help (exit 0); the root
    lists its commands by task (TASKS)."""

    command_class = Command
    group_class = type  # subgroups are of this class

    def parse_args(self, ctx, args):
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def format_options(self, ctx, formatter):
        Command.format_options(self, ctx, formatter)
        self.format_commands(ctx, formatter)

    def format_commands(self, ctx, formatter):
        names = self.list_commands(ctx)
        tasks = TASKS if ctx.parent is None else {"Commands": names}
        for task, members in tasks.items():
            rows = [(n, self.commands[n].get_short_help_str(200)) for n in members if n in self.commands]
            if rows:
                with formatter.section(task):
                    formatter.write_dl(rows)
        left = sorted(set(names) - {n for m in tasks.values() for n in m})
        if left:
            with formatter.section("Other commands"):
                formatter.write_dl([(n, self.commands[n].get_short_help_str(200)) for n in left])
