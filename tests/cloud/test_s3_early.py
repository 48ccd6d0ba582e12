"""An output in object storage goes up as it is made: each rank's files are handed to its process's upload queue as
soon as its save stage has written them (osdpipe.io.upload_queue), while the next ranks convert; ``publish`` then
sends only what is not there yet, and the markers last. A run that fails after some files went up leaves nothing of
them in the prefix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from cloudenv import S3, bucket_with_a_users_job
from helpers import planned, user_env

from osdpipe.io import remote_output, upload_queue
from osdpipe.io.output import OutputError
from osdpipe.spec.reconcile import settle_and_validate

WORLD = 3
RUN_S = 180


def _plan(root: Path, out: Path, upload: remote_output.Upload):
    spec = settle_and_validate({
        "model": {"factory": "userlm:build"},
        "input": {"path": str(root / "optim.pt")},
        "source": {"world_size": 1},
        "target": {"world_size": WORLD},
        "output": {"path": str(out)},
        "runtime": {"mode": "offline", "progress": False},
    })  # fmt: skip
    return replace(planned(spec), upload=upload)


def test_each_ranks_file_is_sent_before_the_next_rank_converts_and_publish_sends_only_the_rest(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from osdpipe.pipeline import stages
    from osdpipe.pipeline.execute import execute

    bucket = bucket_with_a_users_job(monkeypatch, s3_endpoint, tmp_path)
    destination = remote_output.prepare(bucket.url("out"), overwrite=False)
    events: list[tuple[str, object]] = []
    shard, queued = stages.STAGES["shard"], upload_queue.UploadQueue.send

    def sharding(ctx, *args):
        events.append(("shard", ctx.rank))
        return shard(ctx, *args)

    def queueing(self, directory, names):
        events.append(("queued", sorted(names)))
        return queued(self, directory, names)

    monkeypatch.setitem(stages.STAGES, "shard", sharding)
    monkeypatch.setattr(upload_queue.UploadQueue, "send", queueing)
    report = execute(_plan(tmp_path, tmp_path / "job", destination.upload))
    assert report.ok, report.error
    assert events == [
        event for rank in range(WORLD) for event in (("shard", rank), ("queued", [f"rank_{rank}.pt"]))
    ], events

    in_place = [k.removeprefix("out/") for k in bucket.keys("out")]
    assert sorted(k for k in in_place if not k.startswith(".incoming/")) == [f"rank_{r}.pt" for r in range(WORLD)]
    assert all(k.startswith(".incoming/writing/") for k in in_place if k.startswith(".incoming/"))  # each named first
    assert "manifest.json" not in in_place  # the markers wait for publish

    sent: list[list[str]] = []
    real_send = remote_output.send

    def sending(into, directory, names, *counted):
        sent.append(names)
        return real_send(into, directory, names, *counted)

    monkeypatch.setattr(remote_output, "send", sending)
    local = {p.name: p.read_bytes() for p in (tmp_path / "job").iterdir() if p.name.startswith("rank_")}
    shown: list[tuple[int, int]] = []
    manifest_size = (tmp_path / "job" / "manifest.json").stat().st_size
    names = remote_output.publish(destination, tmp_path / "job", lambda done, total: shown.append((done, total)))
    assert sent == [["manifest.json"]], "publish sent again what the ranks had sent"
    assert shown == [(manifest_size, manifest_size)]  # the progress of what it sent
    assert names == [*sorted(local), "manifest.json"]
    fs = bucket.fs()
    assert {name: fs.cat_file(f"{bucket.bucket}/out/{name}") for name in local} == local
    assert [k for k in bucket.keys("out") if "/.incoming/" in k] == []  # the notes gone with the commit


def test_the_queue_uploads_in_the_background_and_says_a_failure_in_one_line(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "rank_0.pt").write_bytes(b"zero")
    (tmp_path / "rank_1.pt").write_bytes(b"one")
    (tmp_path / "manifest.json").write_text("{}")
    destination = remote_output.prepare(s3.url("out"), overwrite=False)
    release, real_send = threading.Event(), remote_output.send
    monkeypatch.setattr(remote_output, "send", lambda *a: (release.wait(30), real_send(*a))[1])
    queue = upload_queue.UploadQueue(destination.upload)
    queue.send(tmp_path, ["rank_0.pt", "manifest.json"])  # a marker is never sent ahead
    assert [k for k in s3.keys("out") if not k.startswith("out/.incoming/")] == []  # sent returned at once
    release.set()
    assert queue.finish() is None
    assert [k for k in s3.keys("out") if not k.startswith("out/.incoming/")] == ["out/rank_0.pt"]

    failing = upload_queue.UploadQueue(destination.upload)
    failing.send(tmp_path, ["rank_9.pt"])  # no such file in the staged conversion
    said = failing.finish()
    assert said is not None and "\n" not in said and s3.url("out", "rank_9.pt") in said, said


def _failing_launcher(bucket: S3, prefix: str) -> str:
    """The ``osdpipe`` command whose last rank fails in its save stage, once the first rank's file is in the bucket
    (so the failure comes after an upload, for certain: without that upload it fails saying so, and the test
    with it)."""
    return (
        "import sys, time\n"
        "import s3fs\n"
        "from osdpipe.pipeline import stages\n"
        "save = stages.STAGES['save']\n"
        "def failing(ctx, before, tally):\n"
        f"    if ctx.rank == {WORLD - 1}:\n"
        "        fs, deadline = s3fs.S3FileSystem(skip_instance_cache=True), time.monotonic() + 60\n"
        f"        while not fs.exists('{bucket.bucket}/{prefix}/rank_0.pt') and time.monotonic() < deadline:\n"
        "            time.sleep(0.05)\n"
        f"        if not fs.exists('{bucket.bucket}/{prefix}/rank_0.pt'):\n"
        "            raise RuntimeError('rank_0.pt never reached the bucket during the run')\n"
        "        raise RuntimeError('injected: the last rank fails after the first rank\\'s file went up')\n"
        "    return save(ctx, before, tally)\n"
        "stages.STAGES['save'] = failing\n"
        "from osdpipe.cli import entry\n"
        "sys.argv = ['osdpipe', *sys.argv[1:]]\n"
        "sys.exit(entry.main())\n"
    )


@pytest.mark.parametrize("over_a_conversion", [False, True], ids=["empty prefix", "over a conversion"])
def test_a_run_that_fails_after_its_first_ranks_file_went_up_leaves_nothing_of_it(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over_a_conversion: bool
) -> None:
    bucket = bucket_with_a_users_job(monkeypatch, s3_endpoint, tmp_path)
    args = ["model.factory=userlm:build", f"input.path={tmp_path / 'optim.pt'}", "source.world_size=1",
            f"target.world_size={WORLD}", "runtime.mode=offline", "output.overwrite=true"]  # fmt: skip
    before = {}
    if over_a_conversion:  # a first conversion in place, to 2 ranks: it stays whole
        first = subprocess.run([sys.executable, "-m", "osdpipe", *args, "target.world_size=2",
                                f"output.path={bucket.url('out')}"], cwd=tmp_path, env=user_env(),
                               capture_output=True, text=True, timeout=RUN_S)  # fmt: skip
        assert first.returncode == 0, first.stderr
        fs = bucket.fs()
        before = {k: fs.cat_file(f"{bucket.bucket}/{k}") for k in bucket.keys("out")}
    prefix = "out/.incoming" if over_a_conversion else "out"
    failed = subprocess.run([sys.executable, "-c", _failing_launcher(bucket, prefix), *args,
                             f"output.path={bucket.url('out')}"], cwd=tmp_path, env=user_env(),
                            capture_output=True, text=True, timeout=RUN_S)  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    assert "injected: the last rank fails after the first rank's file went up" in failed.stderr, failed.stderr
    fs = bucket.fs()
    assert {k: fs.cat_file(f"{bucket.bucket}/{k}") for k in bucket.keys("out")} == before
    if over_a_conversion:
        assert json.loads(before["out/manifest.json"])["config"]["target"]["world_size"] == 2


def test_a_failed_publish_after_the_ranks_sent_their_files_removes_them(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "rank_0.pt").write_bytes(b"zero")
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"rank_0.pt": "x"}}))
    destination = remote_output.prepare(s3.url("out"), overwrite=False)
    queue = upload_queue.UploadQueue(destination.upload)
    queue.send(tmp_path, ["rank_0.pt"])
    assert queue.finish() is None
    pipe_file = destination.fs.pipe_file

    def refuse_the_manifest(key, data, **kwargs):
        if key.endswith("/manifest.json"):
            raise PermissionError("Access Denied")
        return pipe_file(key, data, **kwargs)

    destination.fs.pipe_file = refuse_the_manifest
    with pytest.raises(OutputError, match="access denied"):
        remote_output.publish(destination, tmp_path)
    assert s3.keys("out") == []
