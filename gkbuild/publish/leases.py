"""Leases: a publish in progress says so in the store itself, so ``--prune`` on another host (or
in another process) never deletes the blobs it has stored but not yet committed.

A lease is ``leases/<owner>.json`` holding its owner (a random id), host, process and expiry; it is
taken before the publish lists what the store holds, renewed while it stores blobs, and removed
when it ends. One that outlives its expiry belongs to a publish that died. A prune removes nothing
while another live lease exists, and then judges every temporary as dead: a lease, not a process id
on this host, says whether a writer is alive (a folder store can be a mount shared by hosts).

A lease's expiry is believed only up to ``TTL + SKEW`` after the store last wrote it, so a
malformed lease or one dated far ahead blocks prunes for an hour at most, not for ever. A prune
that a lease stops names it; ``gkbuild leases STORE [--clear NAME]`` lists and removes leases.
Hub stores take no leases (a publish is one commit there).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass

from .. import jsonio
from ..errors import GkError, shown

FOLDER = "leases"
TTL = 3600.0  # seconds a lease lasts unless renewed; a publish renews it at half-life
SKEW = 600.0  # seconds the store's clock (a file's time) may differ from the pruning host's
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
        doc = {"owner": self.owner, "host": socket.gethostname(), "boot": boot_id(), "pid": os.getpid(),
               "expires": self.expires}
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


def boot_id() -> str | None:
    """This machine's current boot (Linux): with the host name, it tells a lease written here, in
    this boot, whose process id can be asked about."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read(64).strip() or None
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Held:
    """One lease file as a prune judges it: its record (``None``: unreadable or malformed), and
    when it stops counting as a publish in progress."""

    name: str
    doc: dict | None
    until: float  # the record's expiry, bounded by when the store last wrote the file
    problem: str | None  # why the record is not believed as it stands

    def here(self) -> bool | None:
        """Whether its publish runs now: True or False when it was written on this host in this
        boot (its process asked), None when that cannot be known from here."""
        d = self.doc or {}
        pid = d.get("pid")
        if d.get("host") != socket.gethostname() or d.get("boot") is None or d.get("boot") != boot_id() \
                or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        return _pid_alive(pid)

    def describe(self, now: float) -> str:
        d = self.doc or {}
        left = self.until - now
        said = [f"owner {str(d.get('owner', '?'))[:12]} on {shown(d.get('host', '?'))} pid {shown(d.get('pid', '?'))}"
                if self.doc else None, f"expires in {left / 60:.0f} min" if left > 0 else
                f"expired {-left / 60:.0f} min ago", self.problem]
        return f"{self.name} ({'; '.join(s for s in said if s)})"


def leases(store) -> list[Held]:
    """Every lease file in the store. A lease's expiry is believed up to ``TTL + SKEW`` after the
    store last wrote the file (a publish renews it at half-life, so a live one is always within
    that): a malformed lease, or one claiming a far-future expiry, stops blocking a prune then."""
    if not store.leases:
        return []
    now = time.time()
    written = store.modified(FOLDER)
    out = []
    for name in sorted(store.list(FOLDER)):
        if not _NAME.match(name):
            continue
        try:
            doc = jsonio.loads(store.get(name, MAX_LEASE) or b"", name, MAX_LEASE)
            ok = isinstance(doc, dict) and isinstance(doc.get("expires"), (int, float)) \
                and not isinstance(doc["expires"], bool) and math.isfinite(doc["expires"])
        except GkError:
            ok = False
        bound = written.get(name, now) + TTL + SKEW
        if not ok:
            out.append(Held(name, None, bound, "malformed"))
        elif doc["expires"] > bound:
            out.append(Held(name, doc, bound, "its expiry is beyond any lease's, bounded by when it was written"))
        else:
            out.append(Held(name, doc, doc["expires"], None))
    return out


def others_alive(store, mine: str | None = None) -> list[Held]:
    """The leases of other publishes in progress (unexpired, as bounded by ``leases``, and not
    known dead: one of this host and boot whose process is gone is dead whatever its expiry)."""
    now = time.time()
    return [h for h in leases(store) if h.name != mine and h.until > now and h.here() is not False]


def blocked(store, others: list[Held], what: str) -> str:
    """Why a prune of ``store`` removed nothing: the lease that blocks it, and how to clear it."""
    now = time.time()
    return (f"{store.uri}: {what} not pruned: {len(others)} publish(es) in progress hold a lease, "
            f"{others[0].describe(now)}; run the prune again later, or if that publish is dead: "
            f"gkbuild leases {store.uri} --clear {others[0].name}")


def dead(store) -> list[str]:
    """Lease files of publishes that died: past their expiry, or of this host and boot with their
    process gone (malformed ones are left to ``gkbuild leases --clear``: gkbuild never wrote them)."""
    now = time.time()
    return [h.name for h in leases(store) if h.doc is not None and (h.until <= now or h.here() is False)]


def clear(store, names: list[str], force: bool = False) -> list[str]:
    """Remove the named lease files (only names a lease has); the names removed. The lease of a
    publish running now on this host is kept unless ``force``."""
    held = {h.name: h for h in leases(store)}
    for n in names:
        if not _NAME.match(n):
            raise GkError(f"--clear {shown(n)}: not a lease name (leases/<32 hex digits>.json, as gkbuild leases "
                          f"lists them)")
        if n not in held:
            raise GkError(f"{store.uri}: holds no lease {n}")
        if held[n].here() and not force:
            raise GkError(f"{store.uri}: {n} is held by a publish running now on this host (pid "
                          f"{held[n].doc['pid']}); clearing it lets a prune delete the blobs it has sent: "
                          f"wait for it, or pass --force")
    store.delete(names)
    return names
