"""A fake DI prefill peer: its own process on 127.0.0.1, speaking the side channel's frames (a
4-byte big-endian length, then JSON) as a hostile or broken prefill would.

    python -m tests.di.fake_prefill --log FILE scripted ANSWERS.json [--byte-delay S]
    python -m tests.di.fake_prefill --log FILE proxy PORT [--drop OP] [--set OP.FIELD=JSON]

``scripted``: after each frame received, the next answer of the list (base64 bytes, sent whole
or one byte every ``--byte-delay`` seconds; an empty one hangs up); once they are spent it reads
on and never answers.
``proxy``: a real prefill engine at 127.0.0.1:PORT behind it; each frame goes to the engine and
its reply back, except an ``--drop`` op (swallowed, never answered), and ``--set`` rewrites a
field of a reply of that op. Either way it prints ``READY <port>``, appends what it sees to the
log (``connect``, ``recv OP``), and exits after ``--life`` seconds: a test of a peer that never
answers fails, it does not hang. Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARGIN = 1.5  # s a stalled exchange may end past its deadline: the expiry is noticed at once; slack for a loaded host


def frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def _recv_frame(sock: socket.socket) -> bytes | None:
    head = _exactly(sock, 4)
    return None if head is None else _exactly(sock, struct.unpack(">I", head)[0])


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _op(data: bytes) -> str:
    try:
        return str(json.loads(data).get("op"))
    except (ValueError, AttributeError):
        return "?"


def _scripted(conn: socket.socket, answers: list[bytes], delay: float, log) -> None:
    pending = list(answers)
    while (data := _recv_frame(conn)) is not None:
        log(f"recv {_op(data)}")
        if not pending:
            continue  # silent from here on
        answer = pending.pop(0)
        if not answer:
            return  # an empty answer: hang up
        if delay:
            for i in range(len(answer)):
                conn.sendall(answer[i:i + 1])
                time.sleep(delay)
        else:
            conn.sendall(answer)


def _proxy(conn: socket.socket, upstream: int, drop: set[str], sets: list[tuple[str, str, object]], log) -> None:
    with socket.create_connection(("127.0.0.1", upstream)) as up:
        while (data := _recv_frame(conn)) is not None:
            op = _op(data)
            log(f"recv {op}")
            if op in drop:
                continue
            up.sendall(struct.pack(">I", len(data)) + data)
            reply = json.loads(_recv_frame(up))
            for rop, field, value in sets:
                if reply.get("op") == rop:
                    reply[field] = value
            conn.sendall(frame(reply))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--life", type=float, default=30.0)
    sub = ap.add_subparsers(dest="mode", required=True)
    sc = sub.add_parser("scripted")
    sc.add_argument("answers")
    sc.add_argument("--byte-delay", type=float, default=0.0)
    px = sub.add_parser("proxy")
    px.add_argument("upstream", type=int)
    px.add_argument("--drop", action="append", default=[])
    px.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    threading.Timer(a.life, os._exit, (0,)).start()
    logf = open(a.log, "a", buffering=1)

    def log(line: str) -> None:
        logf.write(line + "\n")

    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    print(f"READY {ls.getsockname()[1]}", flush=True)
    answers = [base64.b64decode(x) for x in json.loads(Path(a.answers).read_text())] if a.mode == "scripted" else []
    sets = []
    for s in getattr(a, "set", []):
        key, value = s.split("=", 1)
        rop, field = key.split(".", 1)
        sets.append((rop, field, json.loads(value)))
    while True:
        conn, _ = ls.accept()
        log("connect")
        with conn:
            try:
                if a.mode == "scripted":
                    _scripted(conn, answers, a.byte_delay, log)
                else:
                    _proxy(conn, a.upstream, set(a.drop), sets, log)
            except OSError:
                pass
        log("closed")


@contextlib.contextmanager
def fake_prefill(tmp_path: Path, *args: str):
    """The fake in its own process: yields ((host, port), its log file); killed on the way out.
    ``args``: its command line after ``--log`` (``scripted FILE ...`` or ``proxy PORT ...``)."""
    log = tmp_path / f"fake-{time.monotonic_ns()}.log"
    log.touch()
    proc = subprocess.Popen([sys.executable, "-m", "tests.di.fake_prefill", "--log", str(log), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["READY"], line
        yield ("127.0.0.1", int(line[1])), log
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def scripted(tmp_path: Path, answers: list[bytes], *more: str):
    """``fake_prefill`` answering ``answers`` (raw bytes, one after each frame received)."""
    path = tmp_path / f"answers-{time.monotonic_ns()}.json"
    path.write_text(json.dumps([base64.b64encode(a).decode() for a in answers]))
    return fake_prefill(tmp_path, "scripted", str(path), *more)


if __name__ == "__main__":
    main()
