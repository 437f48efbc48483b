"""Leases: a publish in progress says so in the store itself, so ``--prune`` on another host (or
in another process) never deletes the blobs it has stored but not yet committed.

A lease is ``leases/<owner>.json`` holding its owner (a random id), host, process and expiry; it is
taken before the publish lists what the store holds, renewed while it stores blobs, and removed
when it ends. One that outlives its expiry belongs to a publish that died. A prune removes nothing
while another live lease exists, and then judges every temporary as dead: a lease, not a process id
on this host, says whether a writer is alive (a folder store can be a mount shared by hosts).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import uuid

from .. import jsonio
from ..errors import GkError

FOLDER = "leases"
TTL = 3600.0  # seconds a lease lasts unless renewed; a publish renews it at half-life
MAX_LEASE = 4096
_NAME = re.compile(rf"^{FOLDER}/[0-9a-f]{{32}}\.json$")


class Lease:
    """This process's lease on a store (``with Lease(store): ...``)."""

    def __init__(self, store, ttl: float = TTL):
        self.store, self.ttl = store, ttl
        self.owner = uuid.uuid4().hex
        self.name = f"{FOLDER}/{self.owner}.json"
        self.expires = 0.0

    def _put(self, create: bool) -> None:
        self.expires = time.time() + self.ttl
        doc = {"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(), "expires": self.expires}
        self.store.put(self.name, json.dumps(doc).encode(), create=create)

    def renew(self) -> None:
        """Push the expiry forward once half of it is spent (cheap to call often)."""
        if self.expires - time.time() < self.ttl / 2:
            self._put(create=False)

    def __enter__(self) -> "Lease":
        self._put(create=True)
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(GkError, OSError):
            self.store.delete([self.name])


def leases(store) -> dict[str, dict | None]:
    """Every lease file in the store: name -> its record (None: unreadable or malformed)."""
    out = {}
    for name in store.list(FOLDER):
        if not _NAME.match(name):
            continue
        try:
            doc = jsonio.loads(store.get(name, MAX_LEASE) or b"", name, MAX_LEASE)
            ok = isinstance(doc, dict) and isinstance(doc.get("expires"), (int, float)) \
                and not isinstance(doc["expires"], bool)
        except GkError:
            ok = False
        out[name] = doc if ok else None
    return out


def others_alive(store, mine: str | None = None) -> list[dict]:
    """The live leases of other publishes (unexpired; a malformed one counts as live: a prune is
    then skipped, never wrong)."""
    now = time.time()
    return [d or {"owner": n, "host": "?", "expires": now} for n, d in leases(store).items()
            if n != mine and (d is None or d["expires"] > now)]


def expired(store) -> list[str]:
    """Lease files of publishes that died (past their expiry)."""
    now = time.time()
    return [n for n, d in leases(store).items() if d is not None and d["expires"] <= now]
