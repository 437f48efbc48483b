"""An in-memory stand-in for the two huggingface_hub objects gkbuild's hub store calls (``HfApi``
and ``HfFileSystem``), with the same method signatures: the hub path is exercised up to that API
boundary, and every commit is recorded (operations, message, parent) for the tests to read.

Its semantics follow huggingface_hub 1.33.0's source (``hf_api.py``, ``_commit_api.py``, cited
below by line): ``preupload_lfs_files`` sends an LFS file's content and marks the operation
uploaded, but nothing is visible until a ``create_commit`` lists the operation; content the repo's
LFS store already holds is not sent again; a commit is atomic and refused when the branch moved
since ``parent_commit``; an operation is committed once.

``FakeHub(root)`` keeps its state in the folder ``root`` (under a lock), so processes share one
hub: a build's forked workers upload into it, a killed build's uploads stay, a rerun sees them."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete
from huggingface_hub.errors import (HfHubHTTPError, LocalTokenNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

LFS_SIZE = 10 << 20  # the hub stores a file this large through LFS whatever it holds


def _error(cls: type, message: str) -> Exception:
    """huggingface_hub's own exception type, made without an HTTP response object (whose class
    differs between huggingface_hub versions)."""
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    return e


def upload_mode(size: int, sample: bytes) -> str:
    """The hub's answer to the preupload endpoint: ``lfs`` for a large or binary file (the client
    sends the first 512 bytes as ``sample`` for this: _commit_api.py:753), ``regular`` (its content
    inside the commit) for small text; an empty file is regular (_commit_api.py:784)."""
    if size == 0:
        return "regular"
    return "lfs" if size > LFS_SIZE or not _text(sample) else "regular"


def _text(sample: bytes) -> bool:
    if b"\0" in sample:
        return False
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"  # a character cut by the sample's end
    return True


def git_hash(data: bytes) -> str:
    """The oid the hub reports for a regular file (huggingface_hub.utils.sha.git_hash)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Objects:
    """Content by sha256: in memory, or files under a folder (shared by processes)."""

    def __init__(self, root: Path | None):
        self.root, self.mem = root, {}

    def put(self, data: bytes) -> str:
        oid = hashlib.sha256(data).hexdigest()
        if self.root is None:
            self.mem[oid] = data
        elif not (self.root / oid).exists():
            tmp = self.root / f".{oid}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, self.root / oid)
        return oid

    def get(self, oid: str) -> bytes:
        return self.mem[oid] if self.root is None else (self.root / oid).read_bytes()

    def __getstate__(self):
        return {"root": self.root, "mem": self.mem if self.root is None else {}}


@dataclass
class Commit:
    oid: str
    message: str
    parent: str | None
    added: dict[str, int]  # path -> bytes
    deleted: list[str]
    files: dict[str, str]  # path -> sha256 of its content
    objects: _Objects = field(repr=False, compare=False)

    @property
    def tree(self) -> dict[str, bytes]:
        return {p: self.objects.get(o) for p, o in self.files.items()}


@dataclass
class _Info:
    sha: str


@dataclass
class _File:
    path: str
    size: int


@dataclass
class FakeHub:
    root: Path | None = None  # where the state lives when processes share it; None: in memory
    token: str | None = "hf_fake"  # what get_token() would find (None: not logged in)
    repos: dict[str, dict[str, list[Commit]]] = field(default_factory=dict)  # repo -> branch -> commits
    private: dict[str, bool] = field(default_factory=dict)
    lfs: dict[str, set[str]] = field(default_factory=dict)  # repo -> sha256 of the LFS content it holds
    uploads: list[tuple[str, str, int, int]] = field(default_factory=list)  # LFS content sent: repo, path, bytes, pid
    reads: list[str] = field(default_factory=list)  # every file opened (this process)

    def __post_init__(self):
        if self.root is not None:
            (self.root / "objects").mkdir(parents=True, exist_ok=True)
        self.objects = _Objects(self.root / "objects" if self.root is not None else None)
        self._depth = 0

    @contextlib.contextmanager
    def _state(self):
        """Each call sees the state as the last call in any process left it, and leaves its own."""
        if self.root is None or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with open(self.root / "lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self.root / "state.pickle"
            if state.exists():
                self.repos, self.private, self.lfs, self.uploads = pickle.loads(state.read_bytes())
            self._depth = 1
            try:
                yield
            finally:  # what a failed call did stays too (content it uploaded, as on the hub)
                self._depth = 0
                tmp = state.with_name(f".state.{os.getpid()}")
                tmp.write_bytes(pickle.dumps((self.repos, self.private, self.lfs, self.uploads)))
                os.replace(tmp, state)

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

    def whoami(self, token=None, *, cache=False):
        """hf_api.py:2317: no token given or saved is LocalTokenNotFoundError, before any request."""
        if (token or self.token) is None:
            raise LocalTokenNotFoundError("Token is required to call the /whoami-v2 endpoint, but no token found.")
        return {"type": "user", "name": "fake-user"}

    def repo_info(self, repo_id, *, revision=None, **kw):
        with self._state():
            return _Info(self._branch(repo_id, revision)[-1].oid)

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, revision=None, **kw):
        with self._state():
            head = self._branch(repo_id, revision)[-1]
            return [_File(p, len(b)) for p, b in sorted(head.tree.items())]

    def create_repo(self, repo_id, *, exist_ok=False, private=None, **kw):
        with self._state():
            if repo_id not in self.repos:
                root = Commit(hashlib.sha1(repo_id.encode()).hexdigest(), "initial commit", None, {}, [], {},
                              self.objects)
                self.repos[repo_id] = {"main": [root]}
                self.private[repo_id] = bool(private)
            elif not exist_ok:
                raise _error(HfHubHTTPError, "409 exists")

    def create_branch(self, repo_id, *, branch, revision=None, exist_ok=False, **kw):
        """hf_api.py:7108: a branch from ``revision`` (default main); an existing one is a 409."""
        with self._state():
            branches = self.repos[repo_id]
            if branch not in branches:
                branches[branch] = list(self._branch(repo_id, revision))
            elif not exist_ok:
                raise _error(HfHubHTTPError, f"409 branch {branch} exists")

    def delete_branch(self, repo_id, *, branch, **kw):
        with self._state():
            if repo_id not in self.repos or branch not in self.repos[repo_id] or branch == "main":
                raise _error(HfHubHTTPError, f"404 no branch {branch}")
            del self.repos[repo_id][branch]

    def _oid_at(self, head: Commit, path: str) -> str | None:
        """The oid the preupload endpoint reports for a file already at ``path`` (_commit_api.py:773):
        an LFS file's sha256, a regular file's git hash."""
        if path not in head.files:
            return None
        data = self.objects.get(head.files[path])
        return head.files[path] if upload_mode(len(data), data[:512]) == "lfs" else git_hash(data)

    def preupload_lfs_files(self, repo_id, additions, *, token=None, repo_type=None, revision=None, create_pr=None,
                            num_threads=5, free_memory=True, gitignore_content=None):
        """hf_api.py:5380-5544: the upload modes are asked for the additions not uploaded yet; each
        LFS one's content is sent unless the repo's LFS store has it (the batch API answers no
        action: _commit_api.py:517), then it is marked uploaded and, with ``free_memory``, its
        content dropped. Nothing becomes visible."""
        with self._state():
            head = self._branch(repo_id, revision)[-1]  # the endpoint 404s an unknown repo or revision
            new = [a for a in additions if not a._is_uploaded]
            for a in new:
                if a._upload_mode is None:
                    a._upload_mode = upload_mode(a.upload_info.size, a.upload_info.sample)
                    a._should_ignore = False
                    a._remote_oid = self._oid_at(head, a.path_in_repo)
            held = self.lfs.setdefault(repo_id, set())
            for a in (a for a in new if a._upload_mode == "lfs"):
                oid = a.upload_info.sha256.hex()
                if oid not in held:
                    with a.as_file() as f:
                        data = f.read()
                    if hashlib.sha256(data).hexdigest() != oid or len(data) != a.upload_info.size:
                        raise _error(HfHubHTTPError, f"400 {a.path_in_repo}: content does not match its oid")
                    self.objects.put(data)
                    held.add(oid)
                    self.uploads.append((repo_id, a.path_in_repo, len(data), os.getpid()))
                a._is_uploaded = True
                if free_memory:
                    a.path_or_fileobj = b""

    def create_commit(self, repo_id, operations, *, commit_message, commit_description=None, token=None,
                      repo_type=None, revision=None, create_pr=None, num_threads=5, parent_commit=None, **kw):
        """hf_api.py:5095-5377: an operation committed before is refused; the LFS content of the
        additions is preuploaded (:5282); additions identical to the file at their path are dropped
        (:5299) and a commit left empty is not made; the hub then applies every operation or none,
        over ``parent_commit`` only if the branch still points there. An LFS addition names its
        content by oid (_commit_api.py:961), which the repo's LFS store must hold. A copy takes the
        file at ``src_path_in_repo`` in ``src_revision`` (default the target; _commit_api.py:87,
        intra-repo only here)."""
        with self._state():
            ops = list(operations)
            adds = [op for op in ops if isinstance(op, CommitOperationAdd)]
            for a in adds:
                if a._is_committed:
                    raise ValueError(f"CommitOperationAdd {a} has already being committed and cannot be reused.")
            self.preupload_lfs_files(repo_id, adds, revision=revision, free_memory=False)
            commits = self._branch(repo_id, revision)
            head = commits[-1]
            ops = [op for op in ops if not (isinstance(op, CommitOperationAdd) and op._remote_oid is not None
                                            and op._remote_oid == op._local_oid)]
            if not ops:
                return type("CommitInfo", (), {"oid": head.oid})()
            if parent_commit is not None and parent_commit != head.oid:
                raise _error(HfHubHTTPError, "412 the branch moved since parent_commit")
            files, added, deleted = dict(head.files), {}, []
            for op in ops:
                if isinstance(op, CommitOperationAdd):
                    if op._upload_mode == "lfs":
                        oid = op.upload_info.sha256.hex()
                        if oid not in self.lfs.get(repo_id, set()):
                            raise _error(HfHubHTTPError, f"422 {op.path_in_repo}: LFS object {oid} was not uploaded")
                    else:
                        with op.as_file() as f:
                            oid = self.objects.put(f.read())
                    files[op.path_in_repo] = oid
                    added[op.path_in_repo] = op.upload_info.size
                elif isinstance(op, CommitOperationCopy):
                    src = self._branch(repo_id, op.src_revision or revision)[-1]
                    if op.src_path_in_repo not in src.files:
                        raise _error(HfHubHTTPError, f"404 {op.src_path_in_repo}: not in {op.src_revision}")
                    files[op.path_in_repo] = src.files[op.src_path_in_repo]
                    added[op.path_in_repo] = len(self.objects.get(files[op.path_in_repo]))
                elif isinstance(op, CommitOperationDelete):
                    if op.path_in_repo not in files:
                        raise _error(HfHubHTTPError, f"404 {op.path_in_repo}: a file with this name doesn't exist")
                    files.pop(op.path_in_repo)
                    deleted.append(op.path_in_repo)
            oid = hashlib.sha1(f"{head.oid}{commit_message}{sorted(added)}{deleted}".encode()).hexdigest()
            commits.append(Commit(oid, commit_message, head.oid, added, deleted, files, self.objects))
            for a in adds:
                a._is_committed = True
            return type("CommitInfo", (), {"oid": oid})()

    # --- HfFileSystem ---
    def ls(self, path, detail=True, revision=None, **kw):
        """The files at the repo root, as HfFileSystem lists them: an LFS file with its sha256 in
        ``lfs``."""
        with self._state():
            tree = self._branch(path, revision)[-1].tree
        return [{"name": f"{path}/{p}", "size": len(b), "type": "file",
                 "lfs": {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)}
                 if upload_mode(len(b), b[:512]) == "lfs" else None}
                for p, b in sorted(tree.items()) if "/" not in p]

    def open(self, path, mode="rb", block_size=None, revision=None, **kw):
        org, name, rel = path.split("/", 2)
        with self._state():
            head = self._branch(f"{org}/{name}", revision)[-1]
        if rel not in head.files:
            raise FileNotFoundError(path)
        self.reads.append(rel)
        return io.BytesIO(self.objects.get(head.files[rel]))

    def head(self, repo_id: str, branch: str = "main") -> Commit:
        with self._state():
            return self.repos[repo_id][branch][-1]

    def sent(self) -> list[tuple[str, str, int, int]]:
        """Every LFS upload so far (by any process sharing ``root``)."""
        with self._state():
            return list(self.uploads)
