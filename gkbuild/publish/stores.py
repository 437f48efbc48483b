"""Where published builds live: a directory (local disk or a mounted artifact store), or a model
repo on the Hugging Face Hub. Both hold the same tree (``publish.json`` + ``blobs/``) behind one
small interface; only this module touches huggingface_hub's upload and download API.

A directory store commits by renaming ``publish.json`` into place after every blob it names is
durable. A hub store commits once per build (``create_commit`` with the new blobs, the index, and
deletions of blobs the new index no longer names; history keeps them), against the parent commit
it read, so two concurrent publishes cannot interleave. Reading a hub store pins the commit a
branch points to first, so a fetch never mixes two builds.

A streamed build (``compile --to hf://``) sends each blob's content as soon as it is made
(``preupload_lfs_files``), from whichever worker made it; the driver commits each job's blobs to a
branch of the build's own, and the build's one commit copies them from there (LFS files are
copied server-side) with the metadata and the index: until then the build's branch does not move,
and a rerun finds on its own branch the blobs a killed run sent.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

from ..checkpoint import hub
from ..compile.cache_entries import entries
from ..jsonio import open_regular, read_bounded
from ..paths import create as open_new, file_lock, inside
from ..pipeline.state import write_bytes_atomic
from ..checkpoint.safetensors_io import fsync_dir
from ..errors import GkError, naming
from .index import NAME, blobs, parse


def open_store(uri: str | os.PathLike, staging: Path | None = None, api=None, fs=None):
    """A store from ``hf://org/name[@branch]``, ``s3://bucket/prefix`` or a directory path.
    ``staging`` is where a hub publish stages compressed blobs before the commit; ``api``/``fs``
    replace huggingface_hub's ``HfApi``/``HfFileSystem`` (tests)."""
    text = str(uri)
    if text.startswith("hf://"):
        return HubStore(hub.parse(text), staging, api, fs)
    if text.startswith("s3://"):
        from .. import s3
        from .s3 import S3Store

        return S3Store(s3.parse(text))
    if "://" in text:
        raise GkError(f"{text}: unknown store; give a directory, hf://ORG/NAME[@BRANCH] or s3://BUCKET/PREFIX")
    if os.path.exists(text) and not os.path.isdir(text):
        raise GkError(f"{text}: exists and is not a folder, so not a store; give a folder (new, or one gkbuild "
                      f"made), hf://ORG/NAME[@BRANCH] or s3://BUCKET/PREFIX")
    return DirStore(Path(text))


def refuse_foreign(where: str, names: list[str], has_index: bool) -> None:
    """Refuse to publish into a place that holds other things and no index (``--to ~`` by mistake)."""
    other = [n for n in names if n not in (NAME, "blobs", "compile", "leases") and not n.startswith(".")]
    if other and not has_index:
        raise GkError(f"{where}: not empty and not a gkbuild store (holds {other[0]!r}); "
                      f"publish into an empty or new folder")


def _regular(p: Path, what: str) -> None:
    """Refuse a symlink or anything but a plain file where the store should hold one."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise GkError(f"{p}: {what} is missing from the store") from None
    if not stat.S_ISREG(st.st_mode):
        raise GkError(f"{p}: {what} is a symlink or not a plain file; refused")


MAX_INDEX = 256 << 20  # a publish index lists a few thousand files; a bigger one is not read


def live_blobs(store, index: bytes | None) -> set[str]:
    """The blobs a store must keep: those ``index`` (its publish index) names and those its compile
    cache's entries name (a cache and a build may share one store: neither prunes the other's)."""
    keep = blobs(parse(index, NAME)) if index is not None else set()
    return keep | {e["artifact"]["blob"] for e in entries(store) if "artifact" in e}


_PARTIAL = re.compile(r"^\.[0-9a-f]{64}\.(?:zst|raw)\.\d+\.partial$")


def raced(uri: str) -> str:
    """Why a publish that lost a race to commit is refused."""
    return (f"{uri}: another publish committed since this one read the index; nothing of this publish is visible "
            f"(its blobs stay for the next try): run it again")


class DirStore:
    verifies_blobs = True  # a folder can rot or be edited: reused blobs are re-hashed

    leases = True  # blobs land before the index: a concurrent --prune must see a publish in progress

    def __init__(self, root: Path):
        self.root = root
        self.uri = str(root)
        self.concurrency = os.cpu_count() or 1  # CPU-bound (decompress + hash): one file a core
        self.index_read: bytes | None = None  # the index as ``read_index`` last found it

    def _at(self, name: str) -> Path:
        """Where ``name`` lives: never through a symlink inside the store (``blobs/`` or
        ``compile/`` linked elsewhere is refused, for reads, writes and deletes alike)."""
        return inside(self.root, name)

    def require(self) -> None:
        """For a command that only looks (``leases``, ``cache ls``): the store must be there."""
        if not os.path.isdir(self.root):
            link = " (a symlink that leads nowhere, or back to itself)" if os.path.islink(self.root) else ""
            raise GkError(f"{self.root}: no store there{link}; give the folder a publish wrote")

    def read_index(self) -> bytes | None:
        """The publish index as it is now (remembered: ``commit`` replaces only this one)."""
        p = self.root / NAME
        self.index_read = None
        if not os.path.lexists(p):
            return None
        _regular(p, "the publish index")
        if p.stat().st_size > MAX_INDEX:
            raise GkError(f"{p}: {p.stat().st_size} bytes; a publish index is never over {MAX_INDEX}; refused")
        with open_regular(p) as f:
            self.index_read = f.read(MAX_INDEX + 1)
        return self.index_read

    @contextlib.contextmanager
    def open_blob(self, name: str) -> Iterator[BinaryIO]:
        p = self._at(name)
        _regular(p, "a blob")
        with open_regular(p) as f:
            yield f

    def read_range(self, name: str, offset: int, n: int) -> bytes:
        """Exactly bytes [offset, offset + n) of a blob (``publish.frames``: a layer's frames)."""
        with self.open_blob(name) as f:
            data = os.pread(f.fileno(), n, offset)
        if len(data) != n:
            raise GkError(f"{self._at(name)}: ends before byte {offset + n}; the blob changed during the verify")
        return data

    def blob_fd(self, name: str) -> int:
        """A blob opened for reading (a plain file, never through a link): the descriptor
        ``publish.shards`` hashes and then maps in place."""
        p = self._at(name)
        _regular(p, "a blob")
        with open_regular(p) as f:
            return os.dup(f.fileno())

    def stored(self) -> dict[str, int]:
        """Blobs present: name -> stored size."""
        return self.list("blobs")

    def prepare(self) -> None:
        """Create the store, refusing a non-empty folder that is not one (``--to ~`` by mistake)."""
        if self.root.exists():
            if not self.root.is_dir():
                raise GkError(f"{self.root}: exists and is not a folder")
            refuse_foreign(str(self.root), [e.name for e in os.scandir(self.root)], (self.root / NAME).exists())
        self._at("blobs/x").parent.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        """A blob written beside its final name and renamed into place only when complete."""
        final = self._at(name)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.partial")
        try:
            with naming(final), os.fdopen(open_new(tmp), "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def discard(self) -> None:
        """A failed publish leaves only complete, content-named blobs that no index references
        (invisible to readers, reused by the next publish)."""

    def commit(self, index: bytes, added: list[str], message: str) -> str:
        """The index written over exactly the one this publish read (under the store's commit
        lock): of two concurrent publishes the second to commit is refused, as on S3."""
        fsync_dir(self._at("blobs/x").parent)
        read = self.index_read
        with file_lock(self.root):  # commits to this folder take turns (a lock on the folder: no file in it)
            if self.read_index() != read:
                raise GkError(raced(self.uri))
            write_bytes_atomic(self._at(NAME), index)
        self.index_read = index
        return str(self.root / NAME)

    def temporaries(self) -> list[str]:
        """Blob temporaries of publishes (a prune removes them once no other publish is live)."""
        d = self._at("blobs/x").parent
        return [f"blobs/{e.name}" for e in os.scandir(d) if _PARTIAL.match(e.name)
                and e.is_file(follow_symlinks=False)] if d.is_dir() else []

    # -- small named files (the compile cache's entries) ----------------------------------------
    def get(self, name: str, limit: int = MAX_INDEX) -> bytes | None:
        """A small file of the store, or None when absent; refused through a symlink or past ``limit``."""
        p = self._at(name)
        if not os.path.lexists(p):
            return None
        _regular(p, name)
        return read_bounded(p, limit)

    def put(self, name: str, data: bytes, create: bool = True) -> None:
        """``data`` under ``name``, whole or not at all; with ``create`` only where nothing is
        (``s3.Conflict`` otherwise: a hard link never replaces a file)."""
        from ..s3 import Conflict

        final = self._at(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.partial")
        try:
            with naming(final), os.fdopen(open_new(tmp), "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
            if not create:
                os.replace(tmp, final)
            else:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise Conflict(f"{final}: already exists") from None
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(final.parent)

    def _files(self, folder: str) -> list[os.DirEntry]:
        """Plain files in ``folder`` (one level), dot names (temporaries) left out."""
        d = self._at(f"{folder}/x").parent
        return [e for e in os.scandir(d) if e.is_file(follow_symlinks=False) and not e.name.startswith(".")] \
            if d.is_dir() else []

    def list(self, folder: str) -> dict[str, int]:
        """Plain files in ``folder`` (one level): store-relative name -> size."""
        return {f"{folder}/{e.name}": e.stat().st_size for e in self._files(folder)}

    def modified(self, folder: str) -> dict[str, float]:
        """When each plain file in ``folder`` was last written (seconds since the epoch)."""
        return {f"{folder}/{e.name}": e.stat().st_mtime for e in self._files(folder)}

    def delete(self, names: list[str]) -> None:
        for n in names:
            self._at(n).unlink(missing_ok=True)


class HubStore:
    # A reused blob is read back and hashed like a folder store's: the hub checks LFS content
    # against the stored bytes' sha256, not against the content a blob's name promises.
    verifies_blobs = True
    leases = False  # one commit holds the blobs and the index, against the commit read from

    def __init__(self, ref: hub.HubRef, staging: Path | None, api=None, fs=None):
        self.ref, self.uri = ref, ref.uri
        self.staging = staging  # set for a publish: then the repo or branch may not exist yet
        self._api, self._fs = api, fs
        self.commit_sha: str | None = None  # the commit read from (pinned on first use)
        self.concurrency = max(8, os.cpu_count() or 1)  # network-bound: keep several downloads going
        self._tree: dict[str, int] | None = None
        self.stream = False  # a streamed build's worker: ``writer`` sends each blob as it is closed
        self.uncommitted: dict = {}  # blob name -> its CommitOperationAdd, content sent, in no commit yet
        self.side: str | None = None  # a streamed build's own branch, where its blobs are committed as sent
        self.side_sha: str | None = None
        self._side_tree: dict[str, int] = {}

    @property
    def api(self):
        if self._api is None:
            from huggingface_hub import HfApi

            self._api = HfApi()
        return self._api

    @property
    def fs(self):
        if self._fs is None:
            from huggingface_hub import HfFileSystem

            self._fs = HfFileSystem()
        return self._fs

    def _errors(self):
        return hub.errors(self.uri, self.ref.revision)

    def _pin(self, must_exist: bool) -> str | None:
        """The commit the branch points to now (None: no such repo or branch yet, when publishing)."""
        if self.commit_sha is None:
            from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

            with self._errors():
                try:
                    self.commit_sha = self.api.repo_info(self.ref.repo, revision=self.ref.revision).sha
                except (RepositoryNotFoundError, RevisionNotFoundError) as e:
                    if must_exist or isinstance(e, GatedRepoError):
                        raise
        return self.commit_sha

    def _tree_sizes(self) -> dict[str, int]:
        if self._tree is None:
            sha = self._pin(must_exist=self.staging is None)
            self._tree = self._list(sha) if sha is not None else {}
        return self._tree

    def _list(self, sha: str) -> dict[str, int]:
        """The files at a commit: path -> size."""
        with self._errors():
            return {item.path: item.size for item in self.api.list_repo_tree(self.ref.repo, revision=sha, recursive=True)
                    if getattr(item, "size", None) is not None}

    def require(self) -> None:
        """The repo and branch must be there (the hub's own one line if not)."""
        self._pin(must_exist=True)

    def read_index(self) -> bytes | None:
        if NAME not in self._tree_sizes():
            return None
        if self._tree_sizes()[NAME] > MAX_INDEX:
            raise GkError(f"{self.uri}/{NAME}: {self._tree_sizes()[NAME]} bytes; a publish index is never over "
                          f"{MAX_INDEX}; refused")
        with self._errors(), self.fs.open(f"{self.ref.repo}/{NAME}", "rb", revision=self.commit_sha) as f:
            return f.read()

    @contextlib.contextmanager
    def open_blob(self, name: str) -> Iterator[BinaryIO]:
        with self._errors(), self.fs.open(f"{self.ref.repo}/{name}", "rb", revision=self._holding(name),
                                          block_size=0) as f:
            yield f

    def _holding(self, name: str) -> str:
        """The commit a blob is read from (the branch's, or a streamed build's own)."""
        sha = self.commit_sha if name in self._tree_sizes() else self.side_sha if name in self._side_tree else None
        if sha is None:
            raise GkError(f"{self.uri}: {name} is missing from the repo at {self.commit_sha}")
        return sha

    def read_range(self, name: str, offset: int, n: int) -> bytes:
        """Exactly bytes [offset, offset + n) of a blob (``publish.frames``: a layer's frames)."""
        # a seekable file, each read one ranged GET (huggingface_hub/hf_file_system.py:1197-1205;
        # open_blob's block_size=0 streams and cannot seek)
        with self._errors(), self.fs.open(f"{self.ref.repo}/{name}", "rb", revision=self._holding(name),
                                          cache_type="none") as f:
            f.seek(offset)
            data = f.read(n)
        if len(data) != n:
            raise GkError(f"{self.uri}: {name} ends before byte {offset + n}; the blob changed during the verify")
        return data

    def stored(self) -> dict[str, int]:
        """Blobs present: the branch's, and those a streamed build committed to its own branch."""
        return {k: v for k, v in {**self._side_tree, **self._tree_sizes()}.items() if k.startswith("blobs/")}

    def prepare(self) -> None:
        if self.staging is None:
            raise GkError("internal: a hub publish needs a staging folder")
        inside(self.staging.parents[1], f"{self.staging.parent.name}/{self.staging.name}/blobs/x")  # no links
        shutil.rmtree(self.staging, ignore_errors=True)
        (self.staging / "blobs").mkdir(parents=True)

    def check_stream(self) -> None:
        """Before a streamed build does any work: a token, and the repo and branch it will commit
        to (it sends blobs from the start and creates nothing visible before its one commit)."""
        from huggingface_hub.errors import GatedRepoError, LocalTokenNotFoundError, RepositoryNotFoundError, \
            RevisionNotFoundError

        repo, branch = self.ref.repo, self.ref.revision
        first = "; a streamed build does not create the repo or branch it commits to: create it first"
        with self._errors():
            try:
                self.api.whoami()
                self.commit_sha = self.api.repo_info(repo, revision=branch).sha
            except LocalTokenNotFoundError:
                raise GkError(f"{self.uri}: no Hugging Face token (set HF_TOKEN or run `hf auth login`): a streamed "
                              f"build uploads as you") from None
            except RevisionNotFoundError:
                raise GkError(f"{self.uri}: branch {branch!r} does not exist{first} "
                              f"(hf repos branch create {repo} {branch})") from None
            except RepositoryNotFoundError as e:
                if isinstance(e, GatedRepoError):
                    raise
                raise GkError(f"{self.uri}: repository not found on the hub (or not visible with your token)"
                              f"{first} (hf repos create {repo} --private)") from None

    def open_side(self, name: str) -> None:
        """A streamed build's own branch ``name`` (made from the commit read if a killed run did
        not leave it): the blobs it holds count as stored."""
        from huggingface_hub.errors import RevisionNotFoundError

        self.side = name
        with self._errors():
            try:
                self.side_sha = self.api.repo_info(self.ref.repo, revision=name).sha
            except RevisionNotFoundError:
                self.api.create_branch(self.ref.repo, branch=name, revision=self._pin(must_exist=True))
                self.side_sha = self.commit_sha
        self._side_tree = self._list(self.side_sha)

    def commit_side(self, ops: list) -> None:
        """Sent blobs (their CommitOperationAdd) committed to the build's own branch: a rerun
        after a kill finds them there."""
        if ops:
            with self._errors():
                info = self.api.create_commit(self.ref.repo, ops, commit_message=f"gkbuild stream: {len(ops)} blobs",
                                              revision=self.side)
            self.side_sha = info.oid
            self._side_tree.update((op.path_in_repo, op.upload_info.size) for op in ops)

    def streaming(self) -> "HubStore":
        """This store as a streamed build's workers use it (pickled to them): the driver's API
        client (a worker node finds its own token), reads at the commits the driver pinned, and
        each blob sent as it is written; the worker sets ``staging``."""
        w = HubStore(self.ref, None, self._api, self._fs)
        w.commit_sha, w._tree, w.stream = self.commit_sha, self._tree_sizes(), True
        w.side_sha, w._side_tree = self.side_sha, self._side_tree
        return w

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        if not self.stream:
            with naming(self.staging / name), open(self.staging / name, "wb") as f:
                yield f
            return
        self.staging.mkdir(parents=True, exist_ok=True)
        tmp = self.staging / f".{Path(name).name}.{os.getpid()}.partial"
        try:
            with naming(tmp), open(tmp, "wb") as f:
                yield f
            self.uncommitted[name] = self._preupload(name, tmp)
        finally:
            tmp.unlink(missing_ok=True)

    def _preupload(self, name: str, path: Path):
        """Send a staged blob's content now (it becomes visible with the commit that lists it):
        its CommitOperationAdd for that commit. ``preupload_lfs_files`` empties the content of an
        operation it sent (huggingface_hub 1.33.0, hf_api.py:5541-5544); the hub keeps a small text
        file inside the commit instead, so such an operation keeps its bytes."""
        from huggingface_hub import CommitOperationAdd

        op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
        with self._errors():
            self.api.preupload_lfs_files(self.ref.repo, [op], revision=self.ref.revision, free_memory=True)
        if op.path_or_fileobj != b"":
            op.path_or_fileobj = path.read_bytes()
        return op

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self.uncommitted.clear()

    def commit(self, index: bytes, added: list[str], message: str) -> str:
        """One commit: the new blobs, the index, and deletions of blobs the index no longer names
        (nor a compile cache sharing the repo). huggingface_hub uploads large files through LFS
        (the hub's requirement) by itself."""
        from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete

        keep = live_blobs(self, index)
        tree = self._tree_sizes()
        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(self.staging / n)) for n in sorted(added)]
        ops += [CommitOperationCopy(src_path_in_repo=n, path_in_repo=n, src_revision=self.side_sha)
                for n in sorted(blobs(parse(index, NAME)) - tree.keys() - set(added)) if n in self._side_tree]
        ops.append(CommitOperationAdd(path_in_repo=NAME, path_or_fileobj=index))
        ops += [CommitOperationDelete(path_in_repo=n) for n in sorted(tree) if n.startswith("blobs/") and n not in keep]
        try:
            oid = self._commit(ops, message)
        finally:
            self.discard()
        if self.side:
            try:
                with self._errors():
                    self.api.delete_branch(self.ref.repo, branch=self.side)
            except GkError as e:
                from ..progress import warn

                warn(f"{e} (deleting the build's own branch {self.side!r}, after its commit; delete it by hand)")
        return f"{self.uri} commit {oid}"

    def _commit(self, ops: list, message: str) -> str:
        """One commit over the commit read from (refused if the branch moved); its id."""
        with self._errors():
            if self._pin(must_exist=False) is None:
                self.api.create_repo(self.ref.repo, exist_ok=True, private=True)  # builds are not public by accident
                if self.ref.revision != "main":
                    self.api.create_branch(self.ref.repo, branch=self.ref.revision, exist_ok=True)
            info = self.api.create_commit(self.ref.repo, ops, commit_message=message, revision=self.ref.revision,
                                          parent_commit=self.commit_sha)
        self.commit_sha, self._tree = info.oid, None  # later reads see this commit
        return info.oid

    # -- small named files (the compile cache's entries) ----------------------------------------
    def get(self, name: str, limit: int = MAX_INDEX) -> bytes | None:
        size = self._tree_sizes().get(name)
        if size is None:
            return None
        if size > limit:
            raise GkError(f"{self.uri}: {name} is {size} bytes; refusing to read more than {limit}")
        with self._errors(), self.fs.open(f"{self.ref.repo}/{name}", "rb", revision=self.commit_sha) as f:
            return f.read(limit + 1)[:limit]

    def put(self, name: str, data: bytes, create: bool = True) -> None:
        """One commit: the blobs staged by ``writer`` and ``name`` (refused if it exists, with ``create``)."""
        from huggingface_hub import CommitOperationAdd

        from ..s3 import Conflict

        if create and name in self._tree_sizes():
            raise Conflict(f"{self.uri}: {name} already exists")
        staged = sorted(p.relative_to(self.staging).as_posix() for p in (self.staging / "blobs").iterdir()) \
            if self.staging and (self.staging / "blobs").is_dir() else []
        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(self.staging / n)) for n in staged]
        try:
            self._commit(ops + [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data)], f"gkbuild: add {name}")
        finally:
            self.discard()
            if self.staging:
                (self.staging / "blobs").mkdir(parents=True)

    def list(self, folder: str) -> dict[str, int]:
        return {k: v for k, v in self._tree_sizes().items() if k.rpartition("/")[0] == folder}

    def delete(self, names: list[str]) -> None:
        from huggingface_hub import CommitOperationDelete

        if names:
            self._commit([CommitOperationDelete(path_in_repo=n) for n in names], f"gkbuild: remove {len(names)} files")
