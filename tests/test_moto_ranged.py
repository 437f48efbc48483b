"""tests/moto_ranged.py (the tests' and benchmarks' S3 server: ranged GETs read only the bytes asked
for) answers every kind of GET as moto's own server does: the same status, Content-Range and bytes."""

from __future__ import annotations

import os

import boto3
from botocore.exceptions import ClientError

from tests.s3server import MOTO, RANGED, moto_server

N = (6 << 20) + 7  # past moto's in-memory buffer (5 MiB - 1 KiB): the object lives in a temporary file


def _answers(server: list[str], data: bytes) -> dict:
    """status, Content-Range and body of a GET of the object for each Range header (None: none)."""
    ranges = [None, "bytes=0-0", "bytes=5-1000", f"bytes={N - 10}-", "bytes=-7", f"bytes={N - 3}-{N + 50}",
              "bytes=0-1,5-6", "bytes=abc", f"bytes={N}-", "bytes=9-3"]
    with moto_server(server=server) as url:
        s3 = boto3.client("s3", endpoint_url=url)
        s3.create_bucket(Bucket="bkt")
        s3.put_object(Bucket="bkt", Key="k", Body=data)
        out = {}
        for r in ranges:
            try:
                got = s3.get_object(Bucket="bkt", Key="k", **({"Range": r} if r else {}))
                out[r] = (got["ResponseMetadata"]["HTTPStatusCode"], got.get("ContentRange"), got["Body"].read())
            except ClientError as e:
                out[r] = (e.response["ResponseMetadata"]["HTTPStatusCode"], None, b"")
        return out


def test_ranged_gets_answer_as_moto_does():
    data = os.urandom(N)
    ours, moto = _answers(RANGED, data), _answers(MOTO, data)
    assert ours == moto
    assert ours["bytes=5-1000"] == (206, f"bytes 5-1000/{N}", data[5:1001])
    assert ours["bytes=-7"][2] == data[-7:] and ours[None] == (200, None, data)
    assert ours[f"bytes={N}-"][0] == 416 and ours["bytes=0-1,5-6"] == (200, None, data)  # moto answers it whole
