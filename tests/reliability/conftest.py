"""Fixtures of the reliability tests: a real S3-protocol server for the object-store tests (s3_server.py)."""

from s3_server import s3_endpoint, s3_root  # noqa: F401 - pytest fixtures
