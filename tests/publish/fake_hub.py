"""An in-memory stand-in for the two huggingface_hub objects gkbuild's hub store calls (``HfApi``
and ``HfFileSystem``), with the same method signatures: the hub path is exercised up to that API
boundary, and every commit is recorded (operations, message, parent) for the tests to read."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError


def _error(cls: type, message: str) -> Exception:
    """huggingface_hub's own exception type, made without an HTTP response object (whose class
    differs between huggingface_hub versions)."""
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    return e


@dataclass
class Commit:
    oid: str
    message: str
    parent: str | None
    added: dict[str, int]  # path -> bytes uploaded
    deleted: list[str]
    tree: dict[str, bytes]


@dataclass
class _Info:
    sha: str


@dataclass
class _File:
    path: str
    size: int


@dataclass
class FakeHub:
    repos: dict[str, dict[str, list[Commit]]] = field(default_factory=dict)  # repo -> branch -> commits
    private: dict[str, bool] = field(default_factory=dict)
    reads: list[str] = field(default_factory=list)  # every file opened

    # --- HfApi ---
    def _branch(self, repo_id: str, revision: str | None) -> list[Commit]:
        if repo_id not in self.repos:
            raise _error(RepositoryNotFoundError, f"404 {repo_id}")
        branches = self.repos[repo_id]
        rev = revision or "main"
        if rev in branches:
            return branches[rev]
        for commits in branches.values():
            for c in commits:
                if c.oid == rev:
                    return commits[:commits.index(c) + 1]
        raise _error(RevisionNotFoundError, f"404 {repo_id}@{rev}")

    def repo_info(self, repo_id, *, revision=None, **kw):
        commits = self._branch(repo_id, revision)
        return _Info(commits[-1].oid)

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, revision=None, **kw):
        tree = self._branch(repo_id, revision)[-1].tree
        return [_File(p, len(b)) for p, b in sorted(tree.items())]

    def create_repo(self, repo_id, *, exist_ok=False, private=None, **kw):
        if repo_id not in self.repos:
            root = Commit(hashlib.sha1(repo_id.encode()).hexdigest(), "initial commit", None, {}, [], {})
            self.repos[repo_id] = {"main": [root]}
            self.private[repo_id] = bool(private)
        elif not exist_ok:
            raise _error(HfHubHTTPError, "409 exists")

    def create_branch(self, repo_id, *, branch, revision=None, exist_ok=False, **kw):
        branches = self.repos[repo_id]
        if branch not in branches:
            branches[branch] = list(branches["main"])

    def create_commit(self, repo_id, operations, *, commit_message, revision=None, parent_commit=None, **kw):
        commits = self._branch(repo_id, revision)
        head = commits[-1]
        if parent_commit is not None and parent_commit != head.oid:
            raise _error(HfHubHTTPError, "412 the branch moved since parent_commit")
        tree, added, deleted = dict(head.tree), {}, []
        for op in operations:
            if isinstance(op, CommitOperationAdd):
                src = op.path_or_fileobj
                data = src if isinstance(src, bytes) else Path(src).read_bytes()
                tree[op.path_in_repo] = data
                added[op.path_in_repo] = len(data)
            elif isinstance(op, CommitOperationDelete):
                tree.pop(op.path_in_repo)
                deleted.append(op.path_in_repo)
        oid = hashlib.sha1(f"{head.oid}{commit_message}{sorted(added)}".encode()).hexdigest()
        c = Commit(oid, commit_message, head.oid, added, deleted, tree)
        commits.append(c)
        return type("CommitInfo", (), {"oid": oid})()

    # --- HfFileSystem ---
    def ls(self, path, detail=True, revision=None, **kw):
        """The files at the repo root, as HfFileSystem lists them: an LFS file (over 10 MB) with its
        sha256 in ``lfs``, the hub's rule for what goes to LFS."""
        tree = self._branch(path, revision)[-1].tree
        return [{"name": f"{path}/{p}", "size": len(b), "type": "file",
                 "lfs": {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)} if len(b) > 10 << 20 else None}
                for p, b in sorted(tree.items()) if "/" not in p]

    def open(self, path, mode="rb", block_size=None, revision=None, **kw):
        org, name, rel = path.split("/", 2)
        tree = self._branch(f"{org}/{name}", revision)[-1].tree
        if rel not in tree:
            raise FileNotFoundError(path)
        self.reads.append(rel)
        return io.BytesIO(tree[rel])

    def head(self, repo_id: str, branch: str = "main") -> Commit:
        return self.repos[repo_id][branch][-1]
