"""NIXL, as the ``nixl`` Python API (nixl-cu12 on PyPI) exposes it: agents, registration, READ.

The calls are ``nixl_agent``'s (nixl-cu12 1.5.1 on PyPI, ``nixl_cu12/_api.py``):
``nixl_agent(name, nixl_agent_config(enable_prog_thread=..., backends=["UCX"]))`` (:148-189),
``register_memory(tensors)`` (:407), ``get_agent_metadata()`` / ``add_remote_agent(bytes)``
(:869, :899), ``initialize_xfer("READ", local descs, remote descs, remote agent)`` (:612),
``transfer(handle)`` and ``check_xfer_state(handle)`` -> "DONE" | "PROC" | "ERR" (:651, :673),
``get_new_notifs()`` (:783). Descriptors are (address, length, device id) rows with memory type
"DRAM" (``get_xfer_descs`` of an Nx3 array, :1012). Its ``get_serialized_descs`` pickles
(:1214-1223): descriptors are never taken from a peer that way here.

UCX picks its transports from the environment when an agent is made; a DI run on one host goes
over TCP on the loopback device unless the caller set ``UCX_TLS`` / ``UCX_NET_DEVICES`` itself.
"""

from __future__ import annotations

import importlib
import os
import time

import numpy as np

from ..errors import GkError

INSTALL = "pip install 'gkbuild[di]' (NIXL's Python API, nixl-cu12, with torch pinned)"
MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api")
LOCAL = "NIXL_INIT_AGENT"


def api():
    """The nixl module (``nixl_agent``, ``nixl_agent_config``), or one line saying what to install."""
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "nixl_agent"):
            return mod
    raise GkError(f"--prefill nixl needs NIXL, which is not installed: {INSTALL}")


def loopback_env() -> None:
    """UCX over TCP on the loopback device, unless the caller chose transports; UCX's and NIXL's
    native logs quiet below fatal unless asked for (a failure is reported here, in one line)."""
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")


def agent(name: str):
    """A NIXL agent with the UCX backend, quiet below warnings, and without a progress thread:
    the binding's thread polls with no delay (``pthrDelay = 0``, ``_api.py:226``: a core busy for
    as long as the agent lives), so
    the caller progresses it instead: an initiator by polling ``check_xfer_state`` (``Reads``), a
    target whose memory may be read by calling ``progress`` (UCX over TCP serves a remote READ
    only while the target's worker progresses)."""
    loopback_env()
    mod = api()
    import logging

    logging.getLogger("nixl").setLevel(logging.WARNING)  # its handler writes INFO to stdout (logging.py:53)
    try:
        a = mod.nixl_agent(name, mod.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    except Exception as e:  # noqa: BLE001 - the bindings raise their own types
        raise GkError(f"NIXL agent {name}: {type(e).__name__}: {str(e)[:200]}") from None
    if "UCX" not in a.backends:
        raise GkError(f"NIXL agent {name}: the UCX backend is not available in this NIXL build")
    return a


def progress(agents) -> None:
    """One round of progress for each agent (``get_new_notifs`` polls its UCX worker)."""
    for a in agents:
        a.get_new_notifs()


def rows(addr_len: np.ndarray) -> np.ndarray:
    """(address, length) rows -> NIXL's Nx3 (address, length, device 0) uint64 descriptors."""
    out = np.zeros((len(addr_len), 3), dtype=np.uint64)
    out[:, :2] = addr_len
    return out


class Reads:
    """READ transfers posted to several remote agents, waited for together with one deadline."""

    def __init__(self, local):
        self.local = local
        self.handles: list[tuple[str, object, int]] = []  # (remote agent, handle, bytes)

    def post(self, remote: str, local_rows: np.ndarray, remote_rows: np.ndarray) -> None:
        """One READ of ``remote_rows`` (address, length) of agent ``remote`` into ``local_rows``."""
        a = self.local
        try:
            h = a.initialize_xfer("READ", a.get_xfer_descs(rows(local_rows), "DRAM"),
                                  a.get_xfer_descs(rows(remote_rows), "DRAM"), remote)
            state = a.transfer(h)
        except Exception as e:  # noqa: BLE001
            raise GkError(f"NIXL READ from {remote} could not be posted: {type(e).__name__}: {str(e)[:200]}") from None
        if state == "ERR":
            a.release_xfer_handle(h)
            raise GkError(f"NIXL READ from {remote} failed as it was posted")
        self.handles.append((remote, h, int(local_rows[:, 1].sum())))

    def wait(self, timeout: float) -> int:
        """Until every READ is done: bytes moved. An error or the deadline is one line naming
        the remote agents not done; the handles are released either way."""
        deadline = time.monotonic() + timeout
        pending = list(self.handles)
        try:
            while pending:
                still = []
                for remote, h, n in pending:
                    try:
                        state = self.local.check_xfer_state(h)
                        why = ""
                    except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError
                        state, why = "ERR", f": {type(e).__name__}"
                    if state == "ERR":
                        raise GkError(f"NIXL READ from {remote} failed{why} ({len(pending)} of {len(self.handles)} "
                                      f"transfers not done)")
                    if state != "DONE":
                        still.append((remote, h, n))
                pending = still
                if pending and time.monotonic() > deadline:
                    names = sorted({r for r, _, _ in pending})
                    raise GkError(f"NIXL READ timed out after {timeout:g} s: {len(pending)} of {len(self.handles)} "
                                  f"transfers not done (from {', '.join(names)})")
                if pending:
                    time.sleep(0.001)
            return sum(n for _, _, n in self.handles)
        finally:
            self.release()

    def release(self) -> None:
        for _, h, _ in self.handles:
            try:
                self.local.release_xfer_handle(h)
            except Exception:  # noqa: BLE001 - a stuck transfer may refuse to cancel; nothing more to do
                pass
        self.handles = []
