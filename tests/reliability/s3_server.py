"""A real S3-protocol server on 127.0.0.1 for the object-store tests (moto's ThreadedMotoServer).

`s3_endpoint` starts one server per test session on a free port with dummy credentials in
the environment (boto's usual configuration; nothing is read from ~/.aws), and `s3_root`
gives each test its own bucket: ``(url, storage_options)``.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

DUMMY_ENV = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-value",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
             "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("s3fs", reason="the object-store tests need s3fs (requirements-ci.txt)")
    server_mod = pytest.importorskip("moto.server",
                                     reason="the object-store tests need moto[server] (requirements-ci.txt)")
    ThreadedMotoServer = server_mod.ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in DUMMY_ENV}
    os.environ.update(DUMMY_ENV)  # subprocesses (CLI, training workers) inherit them
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_root(s3_endpoint: str) -> tuple[str, dict[str, Any]]:
    """A fresh bucket: ``("s3://<bucket>/run", {"endpoint_url": ...})``."""
    import boto3

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run", {"endpoint_url": s3_endpoint}


def bucket_keys(url: str, options: dict[str, Any]) -> list[str]:
    """Every key in the bucket of `url` (fresh listing)."""
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    return sorted(k.split("/", 1)[1] for k in fs.find(bucket))
