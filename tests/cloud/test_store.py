"""osdpipe.io.store against a real S3 server (tests/cloud/conftest.py): where a path lives, the filesystem opened the
standard way, each failure in one line without a credential."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cloudenv import ACCESS_KEY, AWS_CHAIN, SECRET_KEY
from helpers import user_env

from osdpipe.io import store
from osdpipe.io.formats.base import InputError
from osdpipe.io.output import OutputError

#: Small timeouts for the endpoints that do not answer: a failure in seconds.
QUICK = {"s3": {"config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}}


def test_urls_and_local_paths_are_told_apart() -> None:
    assert store.is_remote("s3://bucket/a/b") and store.is_remote("gs://bucket") and store.is_remote("S3://b/k")
    assert not store.is_remote("/ckpt/optim.pt") and not store.is_remote("s3_like/dir") and not store.is_remote(None)
    assert store.is_url("abfs://c/k") and not store.is_remote("abfs://c/k")
    where = store.parse("s3://bucket//a/b/")
    assert (where.bucket, where.key, where.url, where.path) == ("bucket", "a/b", "s3://bucket/a/b", "bucket/a/b")
    assert where.child("dcp/.metadata").url == "s3://bucket/a/b/dcp/.metadata"
    assert store.parse("gs://bucket").child("x").url == "gs://bucket/x"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("abfs://container/key", "reads and writes s3:// and gs://"),
        ("s3a://bucket/key", "not s3a://; write s3://bucket/key"),  # Hadoop's and Spark's name for it
        ("gcs://bucket/key", "not gcs://; write gs://bucket/key"),
        ("file:///ckpt/optim.pt", "not file://; write /ckpt/optim.pt"),  # this machine's file: its path
        ("file://localhost/ckpt/dir", "not file://; write /ckpt/dir"),
        ("file://server/share/dir", "reads and writes s3:// and gs:// (and local paths), not file://"),
        ("s3://bucket:secret@host/key", "names no bucket"),
        ("s3:///key", "names no bucket"),
        ("s3://bucket/a/../b", "no '.' or '..'"),
    ],
)
def test_a_url_osdpipe_cannot_serve_is_refused_in_one_line(url: str, says: str) -> None:
    with pytest.raises(ValueError, match="^input.path=") as caught:
        store.parse(url, "input.path")
    assert says in str(caught.value) and "\n" not in str(caught.value) and "secret" not in str(caught.value)


def test_the_users_options_go_over_osdpipes_defaults_nested_dicts_merged() -> None:
    options = store.options_for("s3", {"s3": {"config_kwargs": {"connect_timeout": 2}, "anon": True}, "gs": {"x": 1}})
    assert options == {
        "config_kwargs": {"connect_timeout": 2, "read_timeout": 30, "retries": {"max_attempts": 2}},
        "anon": True,
    }
    assert store.DEFAULTS["s3"]["config_kwargs"]["connect_timeout"] == 10  # the defaults themselves unchanged


def test_a_first_look_is_bounded_by_the_options_timeouts() -> None:
    assert store.first_look_s("s3") == (10 + 30) * 2  # the documented default (docs/running.md): 80 s
    assert store.first_look_s("s3", QUICK) == (1 + 1) * 1
    mine = {"s3": {"config_kwargs": {"read_timeout": 5, "retries": {"max_attempts": 3}}}}
    assert store.first_look_s("s3", mine) == (10 + 5) * 3
    assert store.first_look_s("gs") is None  # gcsfs's own timeouts


def test_the_filesystem_finds_the_endpoint_and_credentials_the_standard_way(s3) -> None:
    s3.fs().pipe(f"{s3.bucket}/ckpt/optim.pt", b"x" * 10)
    where = store.parse(s3.url("ckpt/optim.pt"))
    assert store.info(where)["size"] == 10
    assert store.filesystem(where).cat(where.path) == b"x" * 10


def test_every_s3_filesystem_reads_botocores_models_once_and_keeps_its_own_session(s3, monkeypatch) -> None:
    """A run's S3 clients share the one loader of botocore's data (its JSON parsed once a process), while each has
    the session s3fs would give it: the options s3fs leaves to the session (a profile) and the credentials as found
    when it connects."""
    where = store.parse(s3.url("ckpt/models.pt"))
    first, second = store.filesystem(where), store.filesystem(where)
    assert first.session is not second.session
    assert first.session.get_component("data_loader") is second.session.get_component("data_loader")
    first.pipe(where.path, b"m" * 3)
    assert second.cat(where.path) == b"m" * 3
    profiled = store.filesystem(where, {"s3": {"profile": "osdpipe-test-profile"}})
    assert profiled.session.profile == "osdpipe-test-profile"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(InputError, match="no S3 credentials found"):  # read when this one connects, not shared
        store.info(where)


def test_a_missing_key_and_a_missing_bucket_are_each_named(s3) -> None:
    with pytest.raises(InputError) as missing:
        store.info(store.parse(s3.url("ckpt/absent.pt")), where="input.path")
    assert str(missing.value) == (
        f"input.path='{s3.url('ckpt/absent.pt')}': '{s3.url('ckpt/absent.pt')}' does not exist; check the prefix"
    )
    with pytest.raises(OutputError) as bucket:
        store.info(store.parse("s3://osdpipe-no-such-bucket/out"), where="output.path")
    assert str(bucket.value) == (
        f"output.path='s3://osdpipe-no-such-bucket/out': no such bucket 'osdpipe-no-such-bucket' at the endpoint "
        f"{s3.endpoint}; check its name and the endpoint"
    )


def test_no_credentials_is_said_with_where_to_give_them(s3, monkeypatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(InputError, match="no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        store.info(store.parse(s3.url("k")))


def test_an_endpoint_that_does_not_answer_times_out_instead_of_hanging(s3, monkeypatch, silent_endpoint) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", silent_endpoint)
    start = time.monotonic()
    with pytest.raises(InputError) as caught:
        store.info(store.parse(s3.url("k")), QUICK)
    assert time.monotonic() - start < 30
    assert f"the endpoint {silent_endpoint} does not answer (timed out)" in str(caught.value)


def test_an_endpoint_nobody_listens_on_is_named(s3, monkeypatch) -> None:
    with socket.socket() as taken:
        # bound and never listening, kept so through the request: the connection is refused, and no other process
        # can take the port meanwhile (one did, once, and answered nothing: the test saw a timeout)
        taken.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{taken.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
        # a refused connection is said as one whatever the bound, so the bound is wide: s3fs takes 0.8 to 1.3 s here
        # to give up on the refused endpoint, close to QUICK's 2 s, which a busy CI machine once passed (the test
        # then saw a timeout)
        roomy = {"s3": {"config_kwargs": {"connect_timeout": 10, "read_timeout": 10, "retries": {"max_attempts": 1}}}}
        with pytest.raises(InputError, match=f"cannot connect to the endpoint {closed}; check it"):
            store.info(store.parse(s3.url("k")), roomy)


#: What the command may take to say that an endpoint refuses connections (starting Python and importing the store's
#: client included): gcsfs alone retried a refused connection for 35 to 40 s.
REFUSED_S = 15


def test_an_endpoint_nobody_listens_on_is_one_line_naming_the_variable_that_set_it(tmp_path: Path) -> None:
    """Through the command, for each store, for ``input.path``, ``output.path`` and ``inspect``: an error, one line
    that names the endpoint and what set it (gcsfs reads ``STORAGE_EMULATOR_HOST``, not ``AWS_ENDPOINT_URL``),
    within :data:`REFUSED_S`, and nothing of the client's logging (gcsfs logged each retry's traceback)."""
    with socket.socket() as taken:  # bound, never listening: refused (see the test above)
        taken.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{taken.getsockname()[1]}"
        env = {k: v for k, v in user_env().items() if k not in (*AWS_CHAIN, "GOOGLE_APPLICATION_CREDENTIALS")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1",
                   AWS_EC2_METADATA_DISABLED="true", CLOUDSDK_CONFIG=str(tmp_path / "gcloud-absent"))  # fmt: skip
        gs_env = {**env, "STORAGE_EMULATOR_HOST": closed}
        s3_env = {**env, "AWS_ENDPOINT_URL": closed}
        run = ["runtime.mode=offline", "target.world_size=2"]
        options = f"runtime.storage_options={{s3:{{endpoint_url:'{closed}'}}}}"
        said = f"cannot connect to the endpoint {closed}; check it"
        cases = [
            (gs_env, ["input.path=gs://b/src", *run],
             f"osdpipe: error: config: input.path='gs://b/src': {said} (STORAGE_EMULATOR_HOST)"),
            (gs_env, ["output.path=gs://b/out", *run],
             f"osdpipe: error: output.path='gs://b/out': {said} (STORAGE_EMULATOR_HOST)"),
            (gs_env, ["inspect", "gs://b/src"],
             f"osdpipe inspect: error: PATH='gs://b/src': {said} (STORAGE_EMULATOR_HOST)"),
            (s3_env, ["input.path=s3://b/src", *run],
             f"osdpipe: error: config: input.path='s3://b/src': {said} (AWS_ENDPOINT_URL)"),
            (env, ["output.path=s3://b/out", options, *run],
             f"osdpipe: error: output.path='s3://b/out': {said} (runtime.storage_options.s3.endpoint_url)"),
        ]  # fmt: skip
        outputs = []
        for case_env, args, _ in cases:  # one at a time, each timed from its own start: five Pythons importing torch
            # side by side on a busy 2-core CI machine took longer than REFUSED_S from a shared start (CI, once)
            start = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "osdpipe", *args], cwd=tmp_path, env=case_env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
            try:
                out, err = proc.communicate(timeout=REFUSED_S * 4)
            finally:
                proc.kill()
            outputs.append((proc.returncode, out, err, time.monotonic() - start))
    for (_, args, expected), (code, out, err, seconds) in zip(cases, outputs, strict=True):
        assert code == (1 if args[0] == "inspect" else 2), (args, out, err)
        assert err.strip().splitlines() == [expected] and not out.strip(), (args, out, err)
        assert seconds < REFUSED_S, (args, seconds)


def test_no_credential_reaches_a_message() -> None:
    signed = (
        "GET https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAABCDEFGHIJKLMNOP%2F2026"
        "&X-Amz-Signature=deadbeef&X-Amz-Security-Token=tok123 failed; https://user:pa55word@host/x; key "
        f"{ACCESS_KEY} secret {SECRET_KEY} token my-own-session-token"
    )
    options = {"s3": {"key": "AKIAOTHERKEY00000000", "client_kwargs": {"aws_session_token": "my-own-session-token"}}}
    text = store.redact(signed, options)
    for secret in ("AKIAABCDEFGHIJKLMNOP", "deadbeef", "tok123", "pa55word", "my-own-session-token"):
        assert secret not in text, text
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in text and "X-Amz-Signature=***" in text
    assert store.redacted_options({**options, "gs": {"token": None, "project": "p"}}) == {
        "s3": {"key": "***", "client_kwargs": {"aws_session_token": "***"}},
        "gs": {"token": None, "project": "p"},
    }


def test_the_environments_credentials_never_reach_a_failure(s3, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAREFUSEDKEY000000")
    failure = store.failure(
        RuntimeError(f"request with {SECRET_KEY} and AKIAREFUSEDKEY000000 failed"), store.parse(s3.url("k"))
    )
    assert SECRET_KEY not in str(failure) and "AKIAREFUSEDKEY000000" not in str(failure)
    assert str(failure) == f"path='{s3.url('k')}': S3 failed: request with *** and *** failed"


def test_runtime_storage_options_are_recorded_without_a_credential() -> None:
    from osdpipe.spec.config import RuntimeConfig

    runtime = RuntimeConfig(storage_options={"s3": {"endpoint_url": "http://minio:9000", "secret": SECRET_KEY}})
    assert runtime.storage_options["s3"]["secret"] == SECRET_KEY  # the run uses it
    assert runtime.model_dump(mode="json")["storage_options"] == {
        "s3": {"endpoint_url": "http://minio:9000", "secret": "***"}
    }


def test_an_object_store_input_is_taken_and_another_scheme_refused_in_one_line() -> None:
    from pydantic import ValidationError

    from osdpipe.spec.config import InputConfig

    assert InputConfig(path="s3://bucket/ckpt/dcp").path == "s3://bucket/ckpt/dcp"  # asked for when the run is checked
    with pytest.raises(ValidationError, match="osdpipe reads and writes s3:// and gs:// .and local paths., not ftp://"):
        InputConfig(path="ftp://host/ckpt/dcp")


def test_an_output_url_of_another_scheme_is_refused_not_taken_for_a_local_directory() -> None:
    """``output.path=az://c/p`` once converted into a local directory named ``az:`` and said OK."""
    from pydantic import ValidationError

    from osdpipe.spec.config import OutputConfig

    assert OutputConfig(path="gs://bucket/out").path == "gs://bucket/out"
    assert OutputConfig(path="relative/dir").path == "relative/dir"
    with pytest.raises(ValidationError, match="output.path=.az://c/p.: osdpipe reads and writes .* not az://"):
        OutputConfig(path="az://c/p")


def test_a_memory_budget_sets_the_upload_parts() -> None:
    """An eighth of the budget, in 256 KiB steps, at least S3's 5 MiB; two parts at a time on S3 (s3fs sends ten:
    the budget counts two per file); grown where S3's 10,000 parts would not hold the largest file; the client's own
    without a budget."""
    assert store.upload_part_bytes(None) is None
    assert store.upload_part_bytes(1 << 30) == 128 << 20
    assert store.upload_part_bytes(1000 << 20) == 125 << 20  # 125 MiB: a multiple of 256 KiB
    assert store.upload_part_bytes(1 << 20) == store.MIN_PART == 5 << 20
    assert store.upload_options("s3", None, 1 << 40) == {}
    assert store.upload_options("s3", 5 << 20, 12 << 20) == {"chunksize": 5 << 20, "max_concurrency": 2}
    assert store.upload_options("gs", 5 << 20, 12 << 20) == {"chunksize": 5 << 20}
    assert store.parts_in_flight(5 << 20) == 2 and store.parts_in_flight(None) == 4  # a followed file's parts too
    huge = store.upload_options("s3", 5 << 20, 100 << 30)["chunksize"]  # 100 GiB: 10,000 parts of 10.25 MiB
    assert huge % (256 << 10) == 0 and huge * store.MAX_PARTS >= 100 << 30 > (huge - (256 << 10)) * store.MAX_PARTS

