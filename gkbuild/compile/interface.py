"""A kernel library's published interface, read mechanically from its source text.

For each entry point: the parameters in order, each with its name, whether it is required, its
default and its annotation (as source text). For the library: every trace-time switch it reads
(``VLLM_NEURON_MEGA_*`` environment variables), how it is read and where. And where it all came
from: repo, commit, and each file's path and sha256.

gkbuild commits one such file per supported revision (``interfaces/``), made by this module from
the published sources, and holds its program signatures, its switch settings and the tests'
stand-in kernels to it. On a build host the same extraction runs over the checked-out library, so
a revision without a committed file is still checked against its own source::

    python -m gkbuild.compile.interface ROOT --repo OWNER/REPO --commit SHA \\
        --entry src/.../gpt_oss_decode_layer_dp_tp_ep.py:gpt_oss_decode_mega_kernel \\
        [--entry ...] [--scan src/...py ...] --out interfaces/OWNER+REPO@SHA.json

Only ``ast`` is used: nothing of the library is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import GkError
from ..jsonio import open_regular

FORMAT = "gkbuild-kernel-interface-1"
SWITCH_PREFIX = "VLLM_NEURON_MEGA_"
HERE = Path(__file__).resolve().parent / "interfaces"
MAX_SOURCE = 8 << 20  # bytes: a kernel module is tens of kB


@dataclass(frozen=True)
class Param:
    name: str
    required: bool
    default: str | None  # source text of the default; None when required
    annotation: str | None
    kind: str  # positional_or_keyword | keyword_only

    def to_dict(self) -> dict:
        return {"name": self.name, "required": self.required, "default": self.default,
                "annotation": self.annotation, "kind": self.kind}


def _text(path: Path) -> str:
    try:
        with open_regular(path) as f:
            raw = f.read(MAX_SOURCE + 1)
    except OSError as e:
        raise GkError(f"{path}: {e.strerror or e}") from None
    if len(raw) > MAX_SOURCE:
        raise GkError(f"{path}: over {MAX_SOURCE} bytes; not a kernel module")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GkError(f"{path}: not UTF-8 (byte {e.start})") from None


def _tree(text: str, where: str) -> ast.Module:
    try:
        return ast.parse(text)
    except (SyntaxError, RecursionError, ValueError) as e:
        raise GkError(f"{where}: not Python source ({type(e).__name__})") from None


def parameters(text: str, function: str, where: str = "source") -> tuple[list[Param], int]:
    """The parameters of the module-level ``function`` in ``text`` and the line it is defined on."""
    for node in _tree(text, where).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            a = node.args
            if a.vararg or a.kwarg or a.posonlyargs:
                raise GkError(f"{where}: {function} takes *args, **kwargs or positional-only parameters; "
                              f"gkbuild calls kernels by keyword")
            pos = a.args
            defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
            out = [Param(p.arg, d is None, None if d is None else ast.unparse(d),
                         None if p.annotation is None else ast.unparse(p.annotation), "positional_or_keyword")
                   for p, d in zip(pos, defaults)]
            out += [Param(p.arg, d is None, None if d is None else ast.unparse(d),
                          None if p.annotation is None else ast.unparse(p.annotation), "keyword_only")
                    for p, d in zip(a.kwonlyargs, a.kw_defaults)]
            return out, node.lineno
    raise GkError(f"{where}: defines no module-level function {function!r}")


def _const_str(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_environ_get(call: ast.Call) -> bool:
    """``<x>.environ.get(...)``, ``environ.get(...)`` or ``<x>.getenv(...)`` / ``getenv(...)``."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "get":
        v = f.value
        return (isinstance(v, ast.Attribute) and v.attr == "environ") or (isinstance(v, ast.Name) and v.id == "environ")
    return (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv")


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name)
                                                                             and node.id == "environ")


def _is_default_on(call: ast.Call) -> bool:
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return name.lstrip("_") == "mega_flag_default_on"


def switch_reads(text: str, path: str) -> list[dict]:
    """Every read of a ``VLLM_NEURON_MEGA_*`` switch in one module, in source order:
    ``{"name", "read", "default", "expr", "site"}``. ``read`` is ``default_on`` (the library's
    ``mega_flag_default_on``: on unless set to an off value), ``truthy`` (``bool(environ.get(N))``
    or ``environ.get(N)`` as a condition: on when set non-empty) or ``value`` (any other use of ``environ.get(N[, default])``, shown in
    ``expr``)."""
    tree = _tree(text, path)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out, seen = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = _const_str(node.args[0])
        if name is None or not name.startswith(SWITCH_PREFIX):
            continue
        seen.add(id(node.args[0]))
        if _is_default_on(node):
            read, default, expr = "default_on", None, node
        elif _is_environ_get(node):
            default = _const_str(node.args[1]) if len(node.args) > 1 else None
            up = parents.get(node)
            as_bool = isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id == "bool"
            as_test = (isinstance(up, (ast.If, ast.While, ast.IfExp)) and up.test is node) or \
                (isinstance(up, ast.UnaryOp) and isinstance(up.op, ast.Not))
            if as_bool or as_test:
                read, expr = "truthy", up if as_bool else node
            else:
                read, expr = "value", up if isinstance(up, (ast.Compare, ast.BoolOp)) else node
        else:
            seen.discard(id(node.args[0]))
            continue
        out.append({"name": name, "read": read, "default": default, "expr": ast.unparse(expr),
                    "site": f"{path}:{node.lineno}"})
    # A dict key naming the switch its value reads ({"X": os.environ.get("X")}) is that read.
    read_names = {id(n): n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
                  and id(n.args[0]) in seen}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if k is not None and _const_str(k) in {read_names.get(id(n)) for n in ast.walk(v)}:
                    seen.add(id(k))
    # Any other mention of a switch (environ[...], `in environ`, a helper of its own): gkbuild cannot
    # tell how it is read, so it cannot set it explicitly; the build refuses rather than guess.
    for node in ast.walk(tree):
        name = _const_str(node) if isinstance(node, ast.Constant) else None
        if name and name.startswith(SWITCH_PREFIX) and id(node) not in seen:
            up = parents.get(node)
            out.append({"name": name, "read": "unrecognized", "default": None,
                        "expr": ast.unparse(up if up is not None else node)[:200], "site": f"{path}:{node.lineno}"})
    return sorted(out, key=lambda s: (int(s["site"].rsplit(":", 1)[1]), s["name"]))


def environment_reads(text: str, path: str) -> list[str]:
    """Other environment variables a module reads (``environ.get``/``getenv``/``environ[...]``/
    ``in environ``): the trace leaves them unset, so the compiled program does not depend on the
    caller's environment."""
    names = set()
    for node in ast.walk(_tree(text, path)):
        if isinstance(node, ast.Call) and node.args and _is_environ_get(node):
            names.add(_const_str(node.args[0]))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            names.add(_const_str(node.slice))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            names.add(_const_str(node.left))
    return sorted(n for n in names if n and not n.startswith(SWITCH_PREFIX))


def flag_off_values(text: str, where: str = "source") -> list[str] | None:
    """The library's ``_FLAG_OFF_VALUES`` tuple (what ``mega_flag_default_on`` reads as off)."""
    for node in _tree(text, where).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_FLAG_OFF_VALUES"
                                                for t in node.targets):
            try:
                v = ast.literal_eval(node.value)
            except ValueError:
                return None
            return [x for x in v if isinstance(x, str)]
    return None


def module_of(path: str) -> str:
    """Import name of a library file: ``src/nkilib_src/nkilib/a/b.py`` -> ``nkilib.a.b``."""
    parts = Path(path).with_suffix("").parts
    for root in (("src", "nkilib_src"), ("src",)):
        if parts[:len(root)] == root:
            return ".".join(parts[len(root):])
    return ".".join(parts)


def extract(root: Path, repo: str, commit: str, entries: list[str], scan: list[str] = ()) -> dict:
    """The interface document of a library checkout at ``root``: ``entries`` as ``PATH:FUNCTION``,
    switches read in those files and in ``scan`` (paths relative to ``root``)."""
    files, out_entries, switches, off = {}, {}, [], None
    paths = []
    for e in entries:
        path, sep, fn = e.rpartition(":")
        if not sep:
            raise GkError(f"--entry {e!r}: expected PATH:FUNCTION")
        paths.append(path)
        text = _text(root / path)
        params, line = parameters(text, fn, path)
        out_entries[fn] = {"path": path, "module": module_of(path), "line": line,
                           "params": [p.to_dict() for p in params]}
    for path in dict.fromkeys([*paths, *scan]):
        text = _text(root / path)
        files[path] = hashlib.sha256(text.encode()).hexdigest()
        switches += switch_reads(text, path)
        off = flag_off_values(text, path) or off
    return {"format": FORMAT, "repo": repo, "commit": commit, "files": files, "entries": out_entries,
            "switches": switches, "flag_off_values": off}


def scan_switches(root: Path) -> tuple[list[dict], list[str] | None, list[str]]:
    """Every switch read anywhere in a checked-out library (``*.py`` under ``root``), its off
    values, and the other environment variables it reads: what a build host learns of the
    revision it compiles (beyond the files a committed interface covers)."""
    reads, off, other = [], None, set()
    for p in sorted(Path(root).rglob("*.py")):
        if ".git" in p.parts or not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        text = _text(p)
        if "environ" in text or "getenv" in text:
            other.update(environment_reads(text, rel))
        if SWITCH_PREFIX not in text and "_FLAG_OFF_VALUES" not in text:
            continue
        reads += switch_reads(text, rel)
        off = flag_off_values(text, rel) or off
    return reads, off, sorted(other)


def file_name(repo: str, commit: str) -> str:
    return f"{repo.replace('/', '+')}@{commit}.json"


def load(repo: str, commit: str) -> dict | None:
    """The committed interface of ``repo@commit``, or None when gkbuild has none."""
    p = HERE / file_name(repo, commit)
    if not p.is_file():
        return None
    return json.loads(p.read_text())


def committed() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(HERE.glob("*.json"))]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m gkbuild.compile.interface", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="a checkout of the library at the commit")
    ap.add_argument("--repo", required=True, help="OWNER/REPO it was checked out from")
    ap.add_argument("--commit", required=True, help="the full 40-hex commit")
    ap.add_argument("--entry", action="append", required=True, help="PATH:FUNCTION of an entry point")
    ap.add_argument("--scan", action="append", default=[], help="another file whose switch reads to record")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    try:
        doc = extract(a.root, a.repo, a.commit, a.entry, a.scan)
    except GkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
