"""The tests' S3 server itself (tests/cloud/conftest.py): it answers on 127.0.0.1, each test has a bucket of its own,
and the pins of the test extra's S3 client are the ``cloud`` extra's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from cloudenv import ACCESS_KEY

REPO = Path(__file__).resolve().parents[2]


def test_the_server_listens_on_loopback_and_serves_the_tests_bucket(s3) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", s3.endpoint)
    fs = s3.fs()
    fs.pipe(f"{s3.bucket}/a/b.bin", b"\x00\x01")
    assert s3.keys() == ["a/b.bin"]
    assert fs.cat(f"{s3.bucket}/a/b.bin") == b"\x00\x01"


def test_a_subprocess_reaches_the_server_through_the_standard_aws_variables(s3) -> None:
    """Only AWS_ENDPOINT_URL and the credential variables lead a child process to the server, as they lead osdpipe."""
    s3.fs().pipe(f"{s3.bucket}/k", b"seen")
    code = (
        "import os, s3fs; assert os.environ['AWS_ACCESS_KEY_ID'] == %r; "
        "print(s3fs.S3FileSystem(skip_instance_cache=True).cat(%r).decode())" % (ACCESS_KEY, f"{s3.bucket}/k")
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "seen"


def test_the_test_extra_pins_the_cloud_extras_clients() -> None:
    text = (REPO / "pyproject.toml").read_text()

    def extra(name: str) -> dict[str, str]:
        block = text.split(f"\n{name} = [", 1)[1].split("\n]", 1)[0]
        return dict(re.findall(r'"([\w-]+)(?:\[\w+\])?==([^"]+)"', block))

    test, cloud = extra("test"), extra("cloud")
    assert test["moto"] == "5.2.1"
    for name in ("s3fs", "aiobotocore", "gcsfs"):
        assert test[name] == cloud[name], f"{name}: test extra {test[name]}, cloud extra {cloud[name]}"
