"""What the object-storage tests share: the fake credentials, a test's view of the S3 server, its environment.

tests/cloud/conftest.py starts the server and hands each test an :class:`S3`; a test elsewhere (a real framework's
save, converted from a bucket) starts one of its own with :func:`s3_bucket`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The fake credentials every test runs under; tests/cloud look for them in what osdpipe writes.
ACCESS_KEY = "AKIAOSDPIPETESTKEY01"
SECRET_KEY = "osdpipe-test-secret-do-not-print-0123456789"
#: Variables of the AWS credential chain a test must not inherit from the machine.
AWS_CHAIN = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@dataclass(frozen=True)
class S3:
    """One test's view of the server: its endpoint and a bucket of its own, created empty."""

    endpoint: str
    bucket: str

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts joined by />``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def fs(self):
        """An s3fs filesystem on the server, fresh (not fsspec's cached instance), for the test's own looks."""
        import s3fs

        return s3fs.S3FileSystem(
            endpoint_url=self.endpoint, key=ACCESS_KEY, secret=SECRET_KEY, skip_instance_cache=True
        )

    def keys(self, prefix: str = "") -> list[str]:
        """Every object under ``prefix`` of the bucket, as keys relative to the bucket."""
        fs = self.fs()
        root = f"{self.bucket}/{prefix}".rstrip("/")
        return sorted(p.split("/", 1)[1] for p in fs.find(root)) if fs.exists(root) else []


def aws_environment(monkeypatch: pytest.MonkeyPatch, endpoint: str, home: Path) -> None:
    """The test's (and its subprocesses') environment: the server as the endpoint, fake credentials, nothing else."""
    for name in AWS_CHAIN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "aws-config-absent"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "aws-credentials-absent"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def bucket_with_a_users_job(monkeypatch: pytest.MonkeyPatch, endpoint: str, root: Path) -> S3:
    """The environment set (:func:`aws_environment`), a fresh bucket made on the server, and ``root/optim.pt``: the
    FQN-keyed optimizer state of the tests' own model (``userlm``) after 2 steps, the source the tests convert."""
    import uuid

    import torch
    import userlm

    aws_environment(monkeypatch, endpoint, root)
    bucket = S3(endpoint, f"osdpipe-{uuid.uuid4().hex[:16]}")
    bucket.fs().mkdir(bucket.bucket)
    torch.manual_seed(0)
    model = userlm.build()
    torch.save(userlm.fqn_keyed(model, userlm.train(model, steps=2)), root / "optim.pt")
    return bucket


@contextmanager
def s3_bucket(monkeypatch: pytest.MonkeyPatch, home: Path) -> Iterator[S3]:
    """An S3 server of its own on 127.0.0.1 (moto's, in a thread, on a free port), the environment pointing at it
    (:func:`aws_environment`) and a fresh bucket on it; stopped on leaving. For a test outside tests/cloud, whose
    session has no server."""
    import uuid

    server = moto_server()
    try:
        host, port = server.get_host_and_port()
        aws_environment(monkeypatch, f"http://{host}:{port}", home)
        bucket = S3(f"http://{host}:{port}", f"osdpipe-{uuid.uuid4().hex[:16]}")
        bucket.fs().mkdir(bucket.bucket)
        yield bucket
    finally:
        server.stop()


def moto_server() -> Any:
    """moto's S3 server, started in a thread of this process on a free port of 127.0.0.1, its ETags made safe to
    compute from two requests at once.

    moto computes a part's ETag on first asking, reading the part's buffer by seek and read without its lock: an
    ``upload_part`` answering while a ``list_parts`` of the same upload (a test watching parts go up) reads the new
    part interleave their reads, and the ETag cached is of bytes in the wrong order. The completion then fails with
    "One or more of the specified parts could not be found" (once in a CI run). A real store has no such race, so
    the server computes it from the value moto reads under its lock."""
    import hashlib

    from moto.s3.models import FakeKey
    from moto.server import ThreadedMotoServer

    def etag(key: FakeKey) -> str:
        if key._etag is None:
            key._etag = hashlib.md5(key.value).hexdigest()  # ``value``: a copy read under the key's lock
        return f'"{key._etag}"'

    FakeKey.etag = property(etag)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server
