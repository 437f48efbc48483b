"""mkdocs hook: the reference pages gkbuild generates, so they cannot drift from the code.

A page asks for a generated part with a line ``<!-- gkbuild: NAME -->``; NAME is one of GENERATORS.
Each runs the same code a user runs (``gkbuild recipe-doc [--matrix] --json`` through click's test
runner, in this process), or reads the file the code ships (the manifest schema, bench/RESULTS.md).
The command reference itself comes from mkdocs-click (reference/commands.md).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_MARK = re.compile(r"^<!-- gkbuild: ([a-z-]+) -->$", re.M)


def _cell(text) -> str:
    """Text as one Markdown table cell: no pipe ends the cell, no angle bracket opens a tag."""
    s = str(text)
    if len(s) > 1 and s[0] == s[-1] == "`" and "`" not in s[1:-1]:  # a code span: taken literally
        return s.replace("|", "\\|")
    s = s.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return s.replace("*", "\\*").replace("[", "\\[").replace("_", "\\_").replace("\n", " ")


def _table(head: list[str], rows) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _recipe_doc(*args: str) -> dict:
    from click.testing import CliRunner

    from gkbuild.cli import cli

    r = CliRunner().invoke(cli, ["recipe-doc", *args, "--json"], catch_exceptions=False)
    if r.exit_code != 0:
        raise RuntimeError(f"gkbuild recipe-doc {' '.join(args)} --json exited {r.exit_code}: {r.output[-500:]}")
    return json.loads(r.stdout)


def recipe_keys() -> str:
    d = _recipe_doc()
    out = [_table(["key", "default / choices", "meaning"], ((f"`{k['key']}`", k["default"], k["doc"])
                                                            for k in d["keys"]))]
    for rev, entries in d["switches"].items():
        out.append(f"\n### `compile.kernel_switches` of {rev}\n\nEach is set explicitly; a recipe value overrides "
                   "it for the decode.\n\n")
        out.append(_table(["switch", "read as", "gkbuild sets", "numerics", "effect"], (
            (e["name"], e["read"] + (f" (default {e['default']!r})" if e["default"] is not None else ""),
             repr(e["value"]), e["numerics"], e["effect"]) for e in entries)))
    return "".join(out)


def support_matrix() -> str:
    d = _recipe_doc("--matrix")
    rows = []
    for r in d["matrix"]:
        why = r["line"] if r["status"] != "unknown" else f"gkbuild doctor: {r['doctor']}; {r['line']}"
        rows.append((r["target"], r["kv"], r["form"], r["experts"], r["status"], r["rule"] or "",
                     "; ".join(filter(None, [why, *r["notes"]]))))
    out = [_table(["target", "KV", "form", "experts", "verdict", "rule", "why / what decides it"], rows),
           "\n## The rules\n\n"]
    out += [f"- **{k}**: {_cell(r['says'])} ({_cell(r['source'])})\n" for k, r in d["rules"].items()]
    return "".join(out)


def _type(node: dict) -> str:
    if "$ref" in node:
        return node["$ref"].rsplit("/", 1)[-1]
    if "enum" in node:
        return " | ".join(map(json.dumps, node["enum"]))
    if "oneOf" in node:
        return " or ".join(_type(n) for n in node["oneOf"])
    t = node.get("type", "any")
    t = " or ".join(t) if isinstance(t, list) else t
    if t == "array" and "items" in node:
        return f"array of {_type(node['items'])}"
    return t


def _rows(node: dict, prefix: str):
    req = set(node.get("required", ()))
    for name, sub in node.get("properties", {}).items():
        yield (f"`{prefix}{name}`", _type(sub), "yes" if name in req else "", sub.get("description", ""))
        if sub.get("type") == "object" and "properties" in sub:
            yield from _rows(sub, f"{prefix}{name}.")


def manifest_schema() -> str:
    path = ROOT / "gkbuild" / "schemas" / "manifest-v2.json"
    schema = json.loads(path.read_text())
    out = [f"**{schema['title']}** (`gkbuild/schemas/{path.name}`, `$id` {schema['$id']}).\n\n",
           "## Top-level fields\n\n", _table(["field", "type", "required", "description"], _rows(schema, ""))]
    for name, node in schema.get("$defs", {}).items():
        out += [f"\n## `{name}`\n\n"]
        out += [_table(["field", "type", "required", "description"], _rows(node, ""))
                if "properties" in node else f"{_cell(_type(node))}" + (
                    f", pattern `{node['pattern']}`" if "pattern" in node else "") + "\n"]
    out += ["\n## The schema\n\n```json\n", path.read_text().rstrip(), "\n```\n"]
    return "".join(out)


def benchmarks() -> str:
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    return re.sub(r"\A# [^\n]*\n", "", text)  # the page has its own title


GENERATORS = {"recipe-keys": recipe_keys, "support-matrix": support_matrix, "manifest-schema": manifest_schema,
              "benchmarks": benchmarks}


def on_config(config):
    # this checkout's gkbuild, for these generators and for mkdocs-click (mkdocs restores sys.path
    # after loading a hook, so not at import)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_page_markdown(markdown, page, config, files):
    def fill(m):
        try:
            return GENERATORS[m.group(1)]()
        except KeyError:
            raise ValueError(f"{page.file.src_path}: unknown generated part {m.group(1)!r}") from None

    return _MARK.sub(fill, markdown)
