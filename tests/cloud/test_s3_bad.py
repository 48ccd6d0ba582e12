"""A bad object-storage input or output through the ``osdpipe`` command: one line on stderr, no traceback, exit code
2, nothing written at ``output.path``. Each of: no credentials, access denied, an endpoint that takes connections and
never answers (within the documented default timeouts, and within ``runtime.storage_options``' own), for
``input.path`` and ``output.path``. (No such bucket and a missing key are tests/cloud/test_s3_input.py's and
test_s3_output.py's.)

Access is denied by the server itself: moto's server checks every request against its IAM once asked to
(``/moto-api/reset-auth``, what moto's ``set_initial_no_auth_action_count`` posts in server mode), and the command
runs with the keys of an IAM user that no policy allows anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloudenv import S3, bucket_with_a_users_job
from helpers import run_cli_cases, user_env

from osdpipe.io import store

TIMEOUT_S = 120
#: The documented bound of a first look with the default options (docs/running.md: (connect 10 s + read 30 s) x 2
#: attempts), and what the command may take beyond it (starting Python, importing torch, building the model).
FIRST_LOOK_S, START_S = 80, 40
QUICK = "runtime.storage_options={s3:{config_kwargs:{connect_timeout:1,read_timeout:1,retries:{max_attempts:1}}}}"
INPUT = ["model.factory=userlm:build", "source.kind=fsdp2", "source.world_size=4", "runtime.mode=offline",
         "target.world_size=2"]  # fmt: skip


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str, tmp_path_factory) -> Iterator[tuple[S3, Path]]:
    """A bucket holding ``src/dcp/.metadata`` (so that no failure below can be a missing key), and a local source for
    the output cases (``<root>/optim.pt``)."""
    root = tmp_path_factory.mktemp("s3_bad")
    with pytest.MonkeyPatch.context() as monkeypatch:
        here = bucket_with_a_users_job(monkeypatch, s3_endpoint, root)
        here.fs().pipe(f"{here.bucket}/src/dcp/.metadata", b"not read: the first look at the URL fails")
        yield here, root


def _cases(bucket: S3, root: Path, name: str, *extra: str) -> list[list[str]]:
    """An input case (``input.path`` the bucket's, output local) and an output case (input local, output the
    bucket's), both under ``name``."""
    return [
        [*INPUT, f"input.path={bucket.url('src', 'dcp')}", f"output.path={root / name / 'from_s3'}", *extra],
        ["model.factory=userlm:build", f"input.path={root / 'optim.pt'}", "source.world_size=1",
         "runtime.mode=offline", "target.world_size=2", f"output.path={bucket.url(name)}", *extra],
    ]  # fmt: skip


def _one_line(result: dict, expected: str) -> None:
    """The command failed as a bad config does: exit code 2, exactly ``expected`` on stderr, nothing else."""
    assert result["code"] == 2, result
    assert "Traceback" not in result["stderr"] + result["stdout"]
    assert result["stderr"].strip().splitlines() == [expected], result["stderr"]


def _nothing_written(bucket: S3, root: Path, name: str) -> None:
    assert not (root / name).exists(), sorted(p for p in (root / name).rglob("*"))
    assert bucket.keys(name) == []
    assert not list(root.glob("outputs/**/*.pt")) and not list(root.glob("outputs/**/*.distcp"))


def _no_credentials_env(root: Path) -> dict[str, str]:
    (root / "empty-credentials").write_text("")
    (root / "empty-config").write_text("")
    env = {k: v for k, v in user_env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(root / "empty-credentials"), AWS_CONFIG_FILE=str(root / "empty-config"),
               AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
    return env


def test_no_credentials(bucket) -> None:
    s3, root = bucket
    env = _no_credentials_env(root)
    into, out = run_cli_cases(_cases(s3, root, "nocreds"), cwd=root, per_case_s=TIMEOUT_S, env=env)
    how = ("no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile (AWS_PROFILE, "
           "~/.aws/credentials), an instance role, or runtime.storage_options.s3")  # fmt: skip
    _one_line(into, f"osdpipe: error: config: input.path='{s3.url('src', 'dcp')}': {how}")
    _one_line(out, f"osdpipe: error: output.path='{s3.url('nocreds')}': {how}")
    _nothing_written(s3, root, "nocreds")


@pytest.fixture
def denied_keys(bucket) -> Iterator[dict[str, str]]:
    """The keys of an IAM user no policy allows anything; the server checks every request while the test runs."""
    import boto3
    import requests

    s3, _ = bucket
    iam = boto3.client("iam", endpoint_url=s3.endpoint)
    iam.create_user(UserName="osdpipe-denied")
    key = iam.create_access_key(UserName="osdpipe-denied")["AccessKey"]
    assert requests.post(f"{s3.endpoint}/moto-api/reset-auth", data=b"0", timeout=10).ok
    try:
        yield {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    finally:
        assert requests.post(f"{s3.endpoint}/moto-api/reset-auth", data=b"inf", timeout=10).ok
        iam.delete_access_key(UserName="osdpipe-denied", AccessKeyId=key["AccessKeyId"])
        iam.delete_user(UserName="osdpipe-denied")


def test_access_denied(bucket, denied_keys) -> None:
    s3, root = bucket
    into, out = run_cli_cases(_cases(s3, root, "denied"), cwd=root, per_case_s=TIMEOUT_S,
                              env={**user_env(), **denied_keys})  # fmt: skip
    _one_line(into, f"osdpipe: error: config: input.path='{s3.url('src', 'dcp')}': access denied; the credentials "
                    "in use may not read here")  # fmt: skip
    _one_line(out, f"osdpipe: error: output.path='{s3.url('denied')}': access denied; the credentials in use may "
                   "not write here")  # fmt: skip
    assert denied_keys["AWS_SECRET_ACCESS_KEY"] not in into["stderr"] + out["stderr"]
    assert denied_keys["AWS_ACCESS_KEY_ID"] not in into["stderr"] + out["stderr"]


def test_access_denied_wrote_nothing(bucket) -> None:
    s3, root = bucket  # the server checks no request any more: the test's own keys list the bucket
    _nothing_written(s3, root, "denied")


def _silent(endpoint: str) -> str:
    return f"the endpoint {endpoint} does not answer (timed out); check it (AWS_ENDPOINT_URL)"


def test_an_endpoint_that_does_not_answer_fails_within_the_options_timeouts(bucket, silent_endpoint) -> None:
    s3, root = bucket
    into, out = run_cli_cases(_cases(s3, root, "silent", QUICK), cwd=root, per_case_s=TIMEOUT_S,
                              env={**user_env(), "AWS_ENDPOINT_URL": silent_endpoint})  # fmt: skip
    _one_line(into, f"osdpipe: error: config: input.path='{s3.url('src', 'dcp')}': {_silent(silent_endpoint)}")
    _one_line(out, f"osdpipe: error: output.path='{s3.url('silent')}': {_silent(silent_endpoint)}")
    assert into["seconds"] < 15 and out["seconds"] < 15, (into["seconds"], out["seconds"])
    _nothing_written(s3, root, "silent")


def test_an_endpoint_that_does_not_answer_fails_within_the_default_timeouts(bucket, silent_endpoint) -> None:
    """The ``osdpipe`` command itself, both cases at once (each waits on the socket, not on a CPU)."""
    s3, root = bucket
    env = {**user_env(), "AWS_ENDPOINT_URL": silent_endpoint}
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, "-m", "osdpipe", *args], cwd=root, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
        for args in _cases(s3, root, "silent_defaults")
    ]  # fmt: skip
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=FIRST_LOOK_S + START_S + 60 - (time.monotonic() - start))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, 9)
            pytest.fail("the command hung on an endpoint that does not answer")
        results.append({"code": proc.returncode, "stdout": out, "stderr": err, "seconds": time.monotonic() - start})
    into, out = results
    _one_line(into, f"osdpipe: error: config: input.path='{s3.url('src', 'dcp')}': {_silent(silent_endpoint)}")
    _one_line(out, f"osdpipe: error: output.path='{s3.url('silent_defaults')}': {_silent(silent_endpoint)}")
    assert max(r["seconds"] for r in results) < FIRST_LOOK_S + START_S, [r["seconds"] for r in results]
    assert store.first_look_s("s3") == FIRST_LOOK_S
    _nothing_written(s3, root, "silent_defaults")
