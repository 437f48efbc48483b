"""Stand-in kernels built mechanically from gkbuild's committed interface of a published revision
(``gkbuild/compile/interfaces``): the exact parameter list (names, order, required or optional,
defaults), so a missing, extra or misnamed argument fails as Python fails the real call; the body
is written from the source's assertions (``_decode``, the tail module), never from gkbuild's names.

``switch_module`` writes the revision's switch reads as literal source (``_switches.py`` of each
tree), so what a build scans in the stand-in tree is what it would scan in the real one; a test
holds the written files to the interfaces.
"""

import ast
import inspect

from gkbuild.compile import interface

KINDS = {"positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
         "keyword_only": inspect.Parameter.KEYWORD_ONLY}


def doc(revision: str) -> dict:
    repo, _, commit = revision.partition("@")
    d = interface.load(repo, commit)
    assert d is not None, f"no committed interface for {revision}"
    return d


def signature(revision: str, function: str) -> inspect.Signature:
    params = doc(revision)["entries"][function]["params"]
    return inspect.Signature([inspect.Parameter(p["name"], KINDS[p["kind"]], default=inspect.Parameter.empty
                                                if p["required"] else ast.literal_eval(p["default"]))
                              for p in params])


def kernel(revision: str, function: str, body):
    """A callable with ``function``'s published signature whose body gets every argument by name."""
    sig = signature(revision, function)

    def fn(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)  # TypeError for a missing or unknown argument, as the real call
        bound.apply_defaults()
        return body(**bound.arguments)

    fn.__signature__ = sig
    fn.__name__ = fn.__qualname__ = function
    return fn


def switch_module(revision: str, helpers: str | None) -> str:
    """Source of a module whose ``read()`` reads every switch of the revision the way its source
    does (``helpers``: the module holding ``mega_flag_default_on``, for default-on reads)."""
    d = doc(revision)
    lines = [f'"""Generated from gkbuild/compile/interfaces/{interface.file_name(d["repo"], d["commit"])} by',
             'tests/compile/standins/standin.py: every switch the revision reads, read as its source reads it."""',
             "", "import os", ""]
    if helpers:
        lines += [f"from {helpers} import mega_flag_default_on", ""]
    exprs = {}
    for s in d["switches"]:
        n = s["name"]
        if s["read"] == "default_on":
            exprs.setdefault(n, f'mega_flag_default_on("{n}")')
        elif s["read"] == "truthy":
            exprs.setdefault(n, f'bool(os.environ.get("{n}"))')
        else:
            exprs.setdefault(n, f'os.environ.get("{n}"' + (f', "{s["default"]}")' if s["default"] is not None else ")"))
    lines += ["", "def read() -> dict:", "    return {"]
    lines += [f'        "{n}": {e},' for n, e in exprs.items()]
    lines += ["    }", "", "", "def kv_update() -> bool:", f"    return {exprs['VLLM_NEURON_MEGA_KV_UPDATE']}", ""]
    return "\n".join(lines)


def helpers_module(revision: str) -> str:
    """Source of the revision's ``mega_flag_default_on`` over its recorded off values."""
    off = doc(revision)["flag_off_values"]
    return "\n".join([f'"""``mega_flag_default_on`` as {revision} defines it (its _FLAG_OFF_VALUES, from the interface)."""',
                      "", "import os", "", f"_FLAG_OFF_VALUES = {tuple(off)!r}", "", "",
                      "def mega_flag_default_on(name: str) -> bool:",
                      '    return os.environ.get(name, "1") not in _FLAG_OFF_VALUES', ""])
