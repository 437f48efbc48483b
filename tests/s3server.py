"""A real S3 server (moto's) on 127.0.0.1, for the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

MOTO = [sys.executable, "-m", "moto.server"]
# moto with ranged GETs that read only the bytes asked for (tests/moto_ranged.py; tests/test_moto_ranged.py
# holds it to moto's own answers): the default, since moto's copy of a whole object per ranged GET made
# the by-range tests minutes long
RANGED = [sys.executable, str(Path(__file__).with_name("moto_ranged.py"))]


@contextlib.contextmanager
def moto_server(recording: str | None = None, server: list[str] = RANGED,
                log: str | None = None) -> Iterator[str]:
    """Start moto's S3 server on a free port of 127.0.0.1 and point the AWS chain at it (endpoint,
    dummy credentials, no profile files, no instance-metadata lookups); yields the endpoint URL;
    stops the server and restores the environment on exit. Nothing reaches beyond this machine.
    ``recording``: the file moto's request recorder writes to (``/moto-api/recorder/...``), for a
    test that counts requests. ``server``: the command that starts it, given moto's server
    arguments (``RANGED`` unless told; ``MOTO`` is moto's own);
    ``log``: a file for what the server prints (its tracebacks; else nothing is kept)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen([*server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=out, stderr=subprocess.STDOUT,
                            env=dict(os.environ, **({"MOTO_RECORDER_FILEPATH": recording} if recording else {})))
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    old = {k: os.environ.get(k) for k in [*env, "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"]}
    for k in old:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if log:
            out.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
