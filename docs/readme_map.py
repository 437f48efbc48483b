"""Nothing lost: every sentence, table cell and code line of the README before issue 37 (the
1,100-line manual, commit OLD) is on the page its section moved to.

    python docs/readme_map.py            # prints the map; exit 1 naming what a page lacks

MAP is the note of where each README section went. Text is compared after Markdown is taken out
(links become their text; backticks, emphasis and quotes go; whitespace is collapsed), so a
section reference that became a link still matches. The generated reference pages are compared
as they are generated (the hook's generators; the commands page as every command's --help).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD = "583743f"  # main before issue 37: the README that was the whole manual

# README section (its heading) -> the files it went to, relative to the repository root
MAP = {
    "gkbuild": ["README.md", "docs/getting-started.md"],
    "What gkbuild is": ["docs/index.md", "README.md"],
    "The command line": ["docs/reference/cli-overview.md"],
    "Checkpoint sources": ["docs/guides/recipes.md"],
    "Recipes": ["docs/guides/recipes.md"],
    "The published kernels": ["docs/reference/kernels.md"],
    "On a Trainium host, first": ["docs/guides/trainium-host.md"],
    "Kernel layouts (what `gkbuild plan` prints)": ["docs/reference/layouts.md"],
    "A build folder": ["docs/reference/build-folder.md"],
    "How a build runs": ["docs/reference/build-folder.md"],
    "Compiling the decode and the tail": ["docs/guides/build-for-trn3.md"],
    "A shared compile cache": ["docs/guides/compile-farm.md"],
    "A compile farm (`gkbuild farm`)": ["docs/guides/compile-farm.md"],
    "Loading a build (`gkbuild.runtime`)": ["docs/reference/runtime.md"],
    "Device memory": ["docs/guides/build-for-trn3.md"],
    "Verifying a build: the torch twins": ["docs/guides/verify.md"],
    "Disaggregated inference (DI)": ["docs/guides/disaggregated-inference.md"],
    "What the plan means": ["docs/guides/disaggregated-inference.md"],
    "How a vLLM NIXL connector registers regions that match": ["docs/guides/disaggregated-inference.md"],
    "`verify --prefill nixl`": ["docs/guides/disaggregated-inference.md"],
    "Publishing builds": ["docs/guides/publish-from-ci.md"],
    "Streaming a build into a store": ["docs/guides/streaming-builds.md"],
    "Signed builds": ["docs/guides/signed-builds.md"],
    "CI": ["docs/guides/publish-from-ci.md", "README.md"],
    "Where things go": ["docs/reference/files-and-safety.md"],
    "What gkbuild refuses to do": ["docs/reference/files-and-safety.md"],
    "Layout of the code": ["docs/reference/code-layout.md"],
    "Optional: the Neuron SDK": ["docs/guides/trainium-host.md"],
}

# Facts reworded as they moved, old -> new (the new text must be on the section's pages)
REWORDED = {
    "(see CI below)": "(see CI)",  # the CI section is on another page now, linked
    # facts made more precise since (issue 34: synth:// read by range above 16 GiB, never written)
    "synth://PRESET?layers=N&seed=S \u2014 synthesized once into $GKBUILD_CACHE (default ~/.cache/gkbuild) and "
    "reused.": "Up to 16 GiB (every test preset, the 120b up to 8 layers) it is synthesized once into "
               "$GKBUILD_CACHE (default ~/.cache/gkbuild) and reused;",
    "listed at the start; nothing is mirrored.": "listed at the start; nothing is mirrored, nor is a synth:// source "
                                                 "read by range",
    "A folder or synth:// source is memory-mapped as usual.": "A folder or a synthesized synth:// source is "
                                                               "memory-mapped as usual.",
    "ranged.py s3:// and hf:// sources read by byte range (compile --to), no local copy":
        "ranged.py s3://, hf:// (and synth_ranged) sources read by byte range, no local copy",
}


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every #, ## and ### section; a heading inside a code block is code."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,3} (.+)$", line)
        if m:
            out.append((m.group(1).strip(), []))
        elif out:
            out[-1][1].append(line)
    return [(h, "\n".join(b)) for h, b in out]


def plain(text: str) -> str:
    """Markdown reduced to its words."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").replace("**", "").replace('"', "").replace("\\|", "|")
    return re.sub(r"\s+", " ", text).strip()


def units(body: str) -> list[str]:
    """The facts of a section: each sentence of its prose, each cell of its tables, each code line."""
    out, prose, fence = [], [], False
    for line in body.splitlines() + [""]:
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            out.append(line.strip())
        elif line.lstrip().startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
            out += [c for c in cells if not re.fullmatch(r"\s*-*\s*", c)]
        elif line.strip() and not re.match(r"\s*(- |\d+\. )", line):
            prose.append(line)
            continue
        else:
            if line.strip():  # a list item starts a new run of prose
                prose and out.extend(_sentences(" ".join(prose)))
                prose = [re.sub(r"^\s*(- |\d+\. )", "", line)]
                continue
        if prose:
            out.extend(_sentences(" ".join(prose)))
            prose = []
    return [u for u in (plain(u) for u in out) if u]


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.;:!?)])\s+(?=[A-Z(`*\"])", text)


def generated_text() -> str:
    """What the generated pages hold: the hook's parts, and every command's help (mkdocs-click)."""
    import click

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "docs"))
    import hooks

    from gkbuild.cli import cli

    helps = []

    def walk(cmd, path):
        helps.append(cmd.get_help(click.Context(cmd, info_name=path)))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(cli, "gkbuild")
    return "\n".join([*(g() for g in hooks.GENERATORS.values()), *helps])


def missing(old: str) -> dict[str, list[str]]:
    """{README heading: the facts its pages lack}; a heading MAP does not place lacks everything."""
    gen = plain(generated_text())
    lost = {}
    for heading, body in sections(old):
        pages = MAP.get(heading)
        if pages is None:
            lost[heading] = ["(not in MAP: say where this section went)"]
            continue
        text = plain("\n".join((ROOT / p).read_text() for p in pages)) + " " + gen
        gone = [u for u in units(body) if _reworded(u) not in text]
        if gone:
            lost[heading] = gone
    return lost


def _reworded(unit: str) -> str:
    for old, new in REWORDED.items():
        unit = unit.replace(old, new)
    return unit


def old_readme() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD}:README.md"], capture_output=True, text=True)
    if r.returncode != 0:
        raise FileNotFoundError(f"git show {OLD}:README.md: {r.stderr.strip()}")
    return r.stdout


def main() -> int:
    old = old_readme()
    for heading, _ in sections(old):
        print(f"{heading:58} -> {', '.join(MAP.get(heading, ['?']))}")
    lost = missing(old)
    for heading, gone in lost.items():
        for u in gone:
            print(f"LOST from {heading!r}: {u[:150]}", file=sys.stderr)
    print(f"{sum(len(units(b)) for _, b in sections(old))} facts checked; "
          f"{sum(map(len, lost.values()))} not found where MAP says", file=sys.stderr)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
