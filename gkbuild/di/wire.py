"""The out-of-band side channel of a DI transfer: JSON objects in length-prefixed frames over TCP.

NIXL moves the KV bytes; what each side must know first travels here, as vLLM's NixlConnector
sends its handshake over a side channel: the prefill ranks' agent metadata (bytes NIXL's
``add_remote_agent`` loads), their region addresses, the engine's KV format, and per request the
block ids. A frame is a 4-byte big-endian length then UTF-8 JSON; a peer's frame is data: its
size is bounded before it is read, it is parsed by the one bounded reader (``jsonio``: strict,
depth-limited), and every field is checked where it is used: an integer is a JSON integer
or ASCII digits (``integer``, ``digits``), bounded. No pickle (nixl's own ``get_serialized_descs``
pickles; descriptors are rebuilt here from plain numbers).

An exchange with a peer runs under a ``Deadline``: every send and receive of it, and the time
between its frames, counts against one budget, so a peer that never answers, or answers a byte at
a time, is one line when the budget is spent.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import struct
import time

from .. import jsonio
from ..errors import GkError, shown

MAX_FRAME = 64 << 20
VERSION = 1


class Deadline:
    """One exchange's time budget (``phase`` names it in the line its expiry gives)."""

    def __init__(self, seconds: float, phase: str, then: str = ""):
        self.seconds, self.phase, self.then = seconds, phase, then
        self.end = time.monotonic() + seconds

    def left(self, where: str) -> float:
        """Seconds left, or the expiry's line when none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.expired(where)
        return left

    def arm(self, sock: socket.socket, where: str) -> None:
        sock.settimeout(self.left(where))

    def expired(self, where: str) -> GkError:
        return GkError(f"{where}: the {self.phase} did not complete within {self.seconds:g} s{self.then}")


def send(sock: socket.socket, obj: dict, where: str = "DI side channel", deadline: Deadline | None = None) -> None:
    data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise GkError(f"{where}: a {len(data)}-byte message is over the {MAX_FRAME}-byte limit")
    _io(sock, where, deadline, lambda: sock.sendall(struct.pack(">I", len(data)) + data))


def recv(sock: socket.socket, where: str, deadline: Deadline | None = None) -> dict:
    """One object from the peer (within ``deadline``, when given); a closed connection, an
    oversized or non-JSON frame is one line."""
    (n,) = struct.unpack(">I", _exactly(sock, 4, where, deadline))
    if n > MAX_FRAME:
        raise GkError(f"{where}: the peer sent a {n}-byte frame, over the {MAX_FRAME}-byte limit")
    obj = jsonio.loads(_exactly(sock, n, where, deadline), f"{where}: a frame from the peer", MAX_FRAME)
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise GkError(f"{where}: the peer sent {shown(obj)}, not a message")
    if obj["op"] == "error":
        raise GkError(f"{where}: {str(obj.get('message'))[:300]}")
    return obj


def expect(sock: socket.socket, op: str, where: str, deadline: Deadline | None = None) -> dict:
    msg = recv(sock, where, deadline)
    if msg["op"] != op:
        raise GkError(f"{where}: expected a {op!r} message, got {shown(msg['op'])}")
    return msg


def _io(sock: socket.socket, where: str, deadline: Deadline | None, act):
    """``act()`` (one send or receive) in what is left of ``deadline``, not a fresh timeout each
    call; a timeout or a socket error is one line."""
    try:
        if deadline is not None:
            deadline.arm(sock, where)
        return act()
    except socket.timeout:
        if deadline is not None:
            raise deadline.expired(where) from None
        raise GkError(f"{where}: the peer did not answer within {sock.gettimeout():.0f} s") from None
    except OSError as e:
        raise GkError(f"{where}: {e.strerror or e}") from None


def _exactly(sock: socket.socket, n: int, where: str, deadline: Deadline | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = _io(sock, where, deadline, lambda: sock.recv(min(n - len(buf), 1 << 20)))
        if not chunk:
            raise GkError(f"{where}: the peer closed the connection")
        buf += chunk
    return bytes(buf)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text, what: str, limit: int = 16 << 20) -> bytes:
    if not isinstance(text, str) or len(text) > limit * 4 // 3 + 4:
        raise GkError(f"DI handshake: {what} is {shown(text)}, not base64 data")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise GkError(f"DI handshake: {what} is not base64 data") from None


def integer(value, what: str, lo: int = 0, hi: int = 1 << 63) -> int:
    """A peer's integer, within [lo, hi)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
        raise GkError(f"DI side channel: {what} is {shown(value)}; expected an integer in {lo}..{hi - 1}")
    return value


_DIGITS = re.compile(r"0|[1-9][0-9]{0,18}")  # ASCII only: str.isdigit() also takes "²" and "١"


def digits(text, what: str, lo: int = 0, hi: int = 1 << 63) -> int:
    """A peer's integer written as text (a JSON object key, a line): plain ASCII decimal digits,
    at most 19 of them, within [lo, hi)."""
    if not isinstance(text, str) or not _DIGITS.fullmatch(text):
        raise GkError(f"DI side channel: {what} is {shown(text)}; expected ASCII decimal digits")
    return integer(int(text), what, lo, hi)
