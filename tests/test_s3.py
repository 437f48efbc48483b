"""gkbuild.s3: the filesystem follows the AWS chain's endpoint as it is now."""

from __future__ import annotations

import boto3

from gkbuild import s3
from tests.s3server import moto_server


def test_a_new_endpoint_is_talked_to_not_a_cached_filesystems_old_one():
    """Two S3 servers one after the other in one process (as two test modules, or a long-lived
    worker whose AWS_ENDPOINT_URL changes): fsspec caches a filesystem by its arguments, so one
    made for the first endpoint must not answer for the second."""
    for bucket in ("first", "second"):
        with moto_server() as url:
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
            fs = s3.filesystem()
            assert fs.exists(bucket), f"{bucket} not seen at {url}"
