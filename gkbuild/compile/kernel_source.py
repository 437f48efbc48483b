"""Where each Neuron program's kernel comes from: ``compile.kernels.<program>.library`` and ``.entry``.

The published revisions gkbuild knows (CONTRACT.md section 6), each with a committed interface
(``interfaces/``):

- A = aws-neuron/nki-library@e9ef98fc: the decode ``gpt_oss_decode_mega_kernel`` (stacked KV, the
  runtime's x_shard and cos/sin). No commit of aws-neuron/nki-library we can find holds the tail.
- F = baonudesifeizhai/nki-library@9f2490f6: the same decode, later, with the optional forms (paired
  KV, fused embedding, fused RoPE), and the tail ``gpt_oss_tail_chunked_megakernel``.

The decode defaults to A, or to F when the recipe uses a form only F has; the tail defaults to F.

A library is one of:

- ``OWNER/REPO@COMMIT``: a GitHub repository at a commit;
- ``URL@COMMIT`` (``https://``, ``ssh://``, ``git@host:``, ``file://``, or ``git+`` before any of
  them): any git repository at a commit;
- a local folder (relative to the recipe), e.g. a checkout of a fork.

A git source is cloned once into ``$GKBUILD_CACHE/kernels/`` and checked out at the commit,
which must be a full 40-hex sha (a branch name would make builds unreproducible). The revision a
build records is that sha, or for a folder the sha256 of its ``*.py`` files, so a changed kernel
always changes the compile key. Import roots: ``src/`` and ``src/nkilib_src/`` where they exist
(nki-library's layout: ``nkilib_src.nkilib...`` and ``nkilib...``), else the folder itself.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import GkError

A = "aws-neuron/nki-library@e9ef98fc47b3323bf0de8ebcc984b8e2f3adff07"
F = "baonudesifeizhai/nki-library@9f2490f68c3ff0c222458095e169b83778fe59e5"
ENTRIES = {"decode": "nkilib.models.gpt_oss.c128_giga_kernel.experimental.gpt_oss.gpt_oss_decode_layer_dp_tp_ep:"
                     "gpt_oss_decode_mega_kernel",
           "tail": "nkilib.experimental.gpt_oss_tail.tail_chunked_megakernel:gpt_oss_tail_chunked_megakernel"}
_SHA = re.compile(r"^[0-9a-f]{40}$")
_GITHUB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_URL = re.compile(r"^(git\+)?(https://|ssh://|file://|git@[^:]+:)")


@dataclass(frozen=True)
class KernelSource:
    spec: str  # what the recipe wrote
    kind: str  # git | path
    url: str | None
    commit: str | None
    path: Path | None  # a local folder (kind path)

    def describe(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "url": self.url, "commit": self.commit}


def parse(spec: str, base: Path | None = None, where: str = "compile.kernels.decode.library") -> KernelSource:
    """Parse a program's kernel library (no I/O); ``where`` names the recipe key in errors."""
    head, sep, commit = spec.rpartition("@")
    if sep and (_GITHUB.match(head) or _URL.match(head)):
        if not _SHA.match(commit):
            raise GkError(f"{where}: {spec!r}: pin a full 40-hex commit sha after '@' (got {commit!r}); a branch or "
                          f"tag can move")
        url = f"https://github.com/{head}.git" if _GITHUB.match(head) else head.removeprefix("git+")
        return KernelSource(spec, "git", url, commit, None)
    if _URL.match(spec) or (_GITHUB.match(spec) and not Path(spec).exists()):
        raise GkError(f"{where}: {spec!r}: neither an existing folder nor a repository pinned as "
                      f"OWNER/REPO@COMMIT or URL@COMMIT (a full 40-hex sha)")
    p = Path(spec).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    return KernelSource(spec, "path", None, None, p)


def fork_forms(recipe) -> list[str]:
    """The recipe's forms that only F's decode takes (what makes F the decode default)."""
    out = []
    if recipe.kv_cache.form == "paired":
        out.append("kv_cache.form: paired")
    if recipe.decode.embedding != "host":
        out.append(f"decode.embedding: {recipe.decode.embedding}")
    if recipe.decode.rope == "fused":
        out.append("decode.rope: fused")
    return out


def chosen(recipe, program: str) -> tuple[str, str]:
    """(library, entry) of one program: the recipe's, or the defaults."""
    ref = getattr(recipe.compile.kernels, program)
    library = ref.library or (F if program == "tail" or fork_forms(recipe) else A)
    return library, ref.entry or ENTRIES[program]


def interface(src: KernelSource) -> dict | None:
    """The committed interface of a GitHub source at its commit (None for others: their interface
    is read from the checkout when the program is traced)."""
    from . import interface as iface

    m = re.match(r"^https://github\.com/([^/]+/[^/]+?)\.git$", src.url or "")
    return iface.load(m.group(1), src.commit) if m and src.commit else None


def entry_parameters(doc: dict, entry: str) -> list[dict] | None:
    """The parameters an interface document gives ``module:function``; None when it has no such entry."""
    module, _, fn = entry.partition(":")
    e = doc["entries"].get(fn)
    return e["params"] if e and e["module"] == module else None


def revision(src: KernelSource) -> str | None:
    """The code's identity: the commit, or the sha256 of a folder's ``*.py`` files (None when
    the folder is not there)."""
    if src.kind == "git":
        return src.commit
    if not src.path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(src.path.rglob("*.py")):
        if ".git" in f.parts or not f.is_file():
            continue
        h.update(f.relative_to(src.path).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def checkout(src: KernelSource, cache: Path) -> Path:
    """The source's folder on this machine: a git source is cloned (once) and checked out at its
    commit; written beside its final name and renamed, so a killed clone never looks complete."""
    if src.kind == "path":
        if not src.path.is_dir():
            there = os.path.lexists(src.path)
            raise GkError(f"kernel library: {src.path}: {'not a folder' if there else 'no such folder'}")
        return src.path
    name = f"{hashlib.sha256(src.url.encode()).hexdigest()[:16]}-{src.commit}"
    final = Path(cache) / "kernels" / name
    if (final / ".gkbuild-complete").exists():
        return final
    tmp = final.with_name(f".{name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        _git("clone", "--quiet", "--no-checkout", src.url, str(tmp))
        _git("-C", str(tmp), "checkout", "--quiet", "--detach", src.commit)
        head = _git("-C", str(tmp), "rev-parse", "HEAD").strip()
        if head != src.commit:
            raise GkError(f"kernel library: {src.url} checked out {head}, not {src.commit}")
        (tmp / ".gkbuild-complete").write_text(src.commit + "\n")
        try:
            os.replace(tmp, final)
        except OSError:  # a concurrent build finished first: keep its copy
            if not (final / ".gkbuild-complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def import_roots(root: Path) -> list[str]:
    roots = [root / "src", root / "src" / "nkilib_src"]
    found = [str(r) for r in roots if r.is_dir()]
    return found or [str(root)]


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise GkError("kernel library: git is not installed (needed to fetch the kernels)") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise GkError(f"kernel library: git {args[0] if args[0] != '-C' else args[2]} failed: {last[0]}")
    return done.stdout
