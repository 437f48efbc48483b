"""``hf://org/name@revision`` sources through huggingface_hub.

Only what a build reads is downloaded: ``config.json``, the safetensors index, and exactly the
weight files the index names (the hub repos also carry ``original/`` and ``metal/`` copies that a
``*.safetensors`` pattern would drag in). The user's HF cache and ``HF_HUB_OFFLINE`` are honoured.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import GkError
from .reader import INDEX, SINGLE

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_URI = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(?:@(?P<rev>[\w.\-/]+))?$")


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str

    @property
    def uri(self) -> str:
        return f"hf://{self.repo}@{self.revision}"


def parse(uri: str) -> HubRef:
    m = _URI.match(uri)
    if not m:
        raise GkError(f"source {uri!r}: expected hf://ORG/NAME[@REVISION]")
    return HubRef(m["repo"], m["rev"] or "main")


@contextlib.contextmanager
def errors(uri: str, revision: str) -> Iterator[None]:
    """huggingface_hub's exceptions as one line naming the repo and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        yield
    except GatedRepoError:
        raise GkError(f"{uri}: the repository is gated; accept its terms on the hub and log in "
                      f"(huggingface-cli login or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise GkError(f"{uri}: revision {revision!r} does not exist on the hub") from None
    except RepositoryNotFoundError:
        raise GkError(f"{uri}: repository not found on the hub (or not visible with your token)") from None
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise GkError(f"{uri}: revision {revision!r} is not in the local HF cache "
                      f"({constants.HF_HUB_CACHE}) and the hub is unreachable{offline}; download it where "
                      f"the hub is reachable or point HF_HUB_CACHE at a cache that has it") from None
    except HfHubHTTPError as e:
        raise GkError(f"{uri}: the hub refused the request: {str(e).splitlines()[0]}") from None
    except OSError as e:
        raise GkError(f"{uri}: hub request failed: {e}") from None


def _download(ref: HubRef, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        cached = _cached_snapshot(Path(constants.HF_HUB_CACHE), ref, patterns)
        if cached is not None:
            return cached
    with errors(ref.uri, ref.revision):
        return Path(snapshot_download(repo_id=ref.repo, revision=ref.revision, allow_patterns=patterns))


def _cached_snapshot(cache: Path, ref: HubRef, files: list[str]) -> Path | None:
    """Offline: the cache's snapshot of the revision (a commit, or a ref naming one) when it holds
    every file, without asking the hub (some huggingface_hub releases list the repo tree even for a
    cached commit when offline, and fail)."""
    repo = cache / f"models--{ref.repo.replace('/', '--')}"
    commit = ref.revision
    if not _COMMIT.match(commit):
        if ".." in Path(commit).parts:
            return None
        ref_file = repo / "refs" / commit
        try:
            with open(ref_file, "rb") if ref_file.is_file() else contextlib.nullcontext(None) as f:
                commit = f.read(64).decode(errors="replace").strip() if f else ""  # a ref is one sha
        except OSError:
            return None
        if not _COMMIT.match(commit):
            return None
    snap = repo / "snapshots" / commit
    return snap if all((snap / f).is_file() for f in files) else None


def fetch_config(uri: str) -> Path:
    """Only ``config.json`` (what planning needs); returns its path."""
    return _download(parse(uri), ["config.json"]) / "config.json"


def resolve(uri: str) -> tuple[HubRef, Path]:
    """Download (or find in the cache) what a build needs; return the snapshot folder."""
    ref = parse(uri)
    snap = _download(ref, ["config.json", INDEX])
    index = snap / INDEX
    if index.exists():
        from .reader import read_index

        files = sorted(set(read_index(index, f"{ref.uri}/{INDEX}").values()))
    else:
        files = [SINGLE]
    bad = [f for f in files if Path(f).name != f]
    if bad:
        raise GkError(f"{ref.uri}: {INDEX} names weight files outside the repo root: {bad[:3]}")
    snap = _download(ref, ["config.json", INDEX, *files])
    return ref, snap


def tokenizer_files(uri: str, names: tuple[str, ...]) -> Path:
    """The snapshot folder with the repo's tokenizer files (those of ``names`` it has; no weights)."""
    ref = parse(uri)
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # a cache holding tokenizer.json serves, whatever else it lacks
        cached = _cached_snapshot(Path(constants.HF_HUB_CACHE), ref, [names[0]])
        if cached is not None:
            return cached
    return _download(ref, list(names))
