"""Real servers for the object-storage tests, on 127.0.0.1, on free ports, once per session: moto's server mode for
S3, and gcp-storage-emulator (in memory) for Google Cloud Storage's JSON API, which gcsfs reaches through
``STORAGE_EMULATOR_HOST`` as it reaches any emulator.

The server runs in a thread of the test process (``moto.server.ThreadedMotoServer``) and speaks S3's HTTP API like
any S3-compatible store; the code under test reaches it only through ``AWS_ENDPOINT_URL``, as a user points osdpipe at
MinIO or Ceph, so subprocesses (``python -m osdpipe``) reach it too. Each test gets its own bucket, and an environment
holding only fake credentials: no file of the user's (``~/.aws``), no profile and no instance metadata can lend real
ones (tests/cloud/cloudenv.py).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloudenv import S3, aws_environment, moto_server


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The server's URL, ``http://127.0.0.1:<port>``; started on a port the kernel picked, stopped after the session."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not one line per request on the tests' stderr
    server = moto_server()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3:
    """A fresh bucket on the server, and the environment pointing at it (see :func:`aws_environment`)."""
    aws_environment(monkeypatch, s3_endpoint, tmp_path)
    here = S3(s3_endpoint, f"osdpipe-{uuid.uuid4().hex[:16]}")
    here.fs().mkdir(here.bucket)
    assert os.environ["AWS_ENDPOINT_URL"] == s3_endpoint
    return here


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An endpoint on 127.0.0.1 that takes connections and never answers (a hung or firewalled store)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory) -> Iterator[str]:
    """gcp-storage-emulator's URL, ``http://127.0.0.1:<port>``: a process of its own, its objects in memory."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
             "--in-memory"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
