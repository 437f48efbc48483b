"""The out-of-band side channel of a DI transfer: JSON objects in length-prefixed frames over TCP.

NIXL moves the KV bytes; what each side must know first travels here, as vLLM's NixlConnector
sends its handshake over a side channel: the prefill ranks' agent metadata (bytes NIXL's
``add_remote_agent`` loads), their region addresses, the engine's KV format, and per request the
block ids. A frame is a 4-byte big-endian length then UTF-8 JSON; a peer's frame is data: its
size is bounded before it is read, it is parsed by the one bounded reader (``jsonio``: strict,
depth-limited), and every field is checked where it is used. No pickle
(nixl's own ``get_serialized_descs`` pickles; descriptors are rebuilt here from plain numbers).
"""

from __future__ import annotations

import base64
import json
import socket
import struct

from .. import jsonio
from ..errors import GkError, shown

MAX_FRAME = 64 << 20
VERSION = 1


def send(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise GkError(f"DI side channel: a {len(data)}-byte message is over the {MAX_FRAME}-byte limit")
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv(sock: socket.socket, where: str) -> dict:
    """One object from the peer; a closed connection, an oversized or non-JSON frame is one line."""
    (n,) = struct.unpack(">I", _exactly(sock, 4, where))
    if n > MAX_FRAME:
        raise GkError(f"{where}: the peer sent a {n}-byte frame, over the {MAX_FRAME}-byte limit")
    obj = jsonio.loads(_exactly(sock, n, where), f"{where}: a frame from the peer", MAX_FRAME)
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise GkError(f"{where}: the peer sent {shown(obj)}, not a message")
    if obj["op"] == "error":
        raise GkError(f"{where}: {str(obj.get('message'))[:300]}")
    return obj


def expect(sock: socket.socket, op: str, where: str) -> dict:
    msg = recv(sock, where)
    if msg["op"] != op:
        raise GkError(f"{where}: expected a {op!r} message, got {shown(msg['op'])}")
    return msg


def _exactly(sock: socket.socket, n: int, where: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except socket.timeout:
            raise GkError(f"{where}: the peer did not answer within {sock.gettimeout():.0f} s") from None
        except OSError as e:
            raise GkError(f"{where}: {e.strerror or e}") from None
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
        raise GkError(f"DI handshake: {what} is {shown(value)}; expected an integer in {lo}..{hi - 1}")
    return value
