"""A conversion into ``s3://`` killed for real (SIGKILL to the command's whole process group) while it uploads, and
while it commits: the prefix keeps one whole conversion, ``osdpipe check`` and the next run name what the killed run
left, PyTorch's own ``FsspecReader`` loads what is there, and a third run leaves nothing stray.

Nothing in osdpipe waits for the test: the kill lands because the upload is long. The run that is killed converts
a source osdpipe generates (an MLP of width 2048, depth 8: its optimizer state about 270 MB, kept in the conversion
as ``source/optim.pt``) that goes up in parts beside eight small DCP files; the runs that finish, before and after
it, convert a small one (width 256, 4 MB: the same steps on a sixty-fourth of the bytes; nothing is timed against
them, so they move few bytes through moto's server). The test polls the bucket
and kills the command as soon as the new conversion's big file is going up in parts under ``<prefix>/.incoming/``
(mid-upload), or as soon as ``.incoming/manifest.json`` is there (the commit: server-side copies of the same bytes
into place). A first conversion into an empty prefix goes straight to its keys, markers last: killed as soon as its
first file is in place (a rank's, sent as soon as it was written), it leaves no marker a reader keys on, and the next
run removes what it wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cloudenv import S3, aws_environment
from helpers import user_env

from osdpipe.io.remote_output import INCOMING

#: End to end: three runs each, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop).
pytestmark = pytest.mark.slow

#: The conversion every run makes, but the model's width.
CONVERSION = [
    "model=mlp", "model.kwargs.depth=8", "source.world_size=2", "target.kind=fsdp2", "output.format=dcp",
    "runtime.mode=offline", "pipeline.checks=[roundtrip]",
]  # fmt: skip
#: The killed run's: big enough that its upload and its commit each take seconds against moto's server.
KILLED = [*CONVERSION, "model.kwargs.width=2048"]
#: The runs that finish: the same steps on a small model (nothing waits on them).
FINISHED = [*CONVERSION, "model.kwargs.width=256"]
RUN_S = 300
#: How long the killed run may take to reach the point the test kills it at.
REACH_S = 240
POLL_S = 0.05


def _osdpipe(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """The ``osdpipe`` command in a session of its own (its ranks too), its output into ``log``.{out,err}."""
    return subprocess.Popen(
        [sys.executable, "-m", "osdpipe", *args],
        cwd=cwd,
        env=user_env(),
        stdout=log.with_suffix(".out").open("w"),
        stderr=log.with_suffix(".err").open("w"),
        start_new_session=True,
    )


def _finished(proc: subprocess.Popen, log: Path) -> dict:
    try:
        code = proc.wait(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"osdpipe did not finish within {RUN_S} s:\n{log.with_suffix('.err').read_text()}")
    return {"code": code, "stdout": log.with_suffix(".out").read_text(), "stderr": log.with_suffix(".err").read_text()}


def _run(args: list[str], cwd: Path, name: str) -> dict:
    return _finished(_osdpipe(args, cwd, cwd / name), cwd / name)


def _kill_when(proc: subprocess.Popen, s3: S3, prefix: str, reached, under: str = INCOMING) -> list[str]:
    """Poll the bucket until ``reached(keys under <prefix>/<under>/)``, then SIGKILL the command's process group;
    returns the keys seen then."""
    deadline = time.monotonic() + REACH_S
    inside = f"{prefix}/{under}".rstrip("/")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before the point to kill it at was seen")
        seen = [k.removeprefix(f"{inside}/") for k in s3.keys(inside)]
        if reached(seen):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            return seen
        time.sleep(POLL_S)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    pytest.fail(f"no point to kill the run at within {REACH_S} s")


def _objects(s3: S3, prefix: str) -> dict[str, tuple[int, str]]:
    """Every object under ``prefix`` (outside ``.incoming/``): its size and ETag."""
    fs = s3.fs()
    found = fs.find(f"{s3.bucket}/{prefix}", detail=True)
    return {
        key.split("/", 2)[2]: (info["size"], info["ETag"])
        for key, info in found.items()
        if not key.split("/", 2)[2].startswith(INCOMING + "/")
    }


def _world(s3: S3, prefix: str) -> int:
    return json.loads(s3.fs().cat_file(f"{s3.bucket}/{prefix}/manifest.json"))["config"]["target"]["world_size"]


def _uploads_in_flight(s3: S3, prefix: str) -> list[str]:
    """Multipart uploads begun under ``prefix`` and neither completed nor aborted."""
    answer = s3.fs().call_s3("list_multipart_uploads", Bucket=s3.bucket, Prefix=f"{prefix}/")
    return sorted(u["Key"] for u in answer.get("Uploads", []))


def _loads_with_pytorchs_reader(s3: S3, prefix: str, monkeypatch, tmp_path: Path) -> int:
    """Every tensor of ``<prefix>/dcp`` read by ``dcp.load`` through ``FsspecReader``; how many there are."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    aws_environment(monkeypatch, s3.endpoint, tmp_path)
    metadata = FsspecReader(s3.url(prefix, "dcp")).read_metadata().state_dict_metadata
    state = {
        key: torch.full(meta.size, float("nan"), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=FsspecReader(s3.url(prefix, "dcp")), no_dist=True)
    assert state and all(not t.is_floating_point() or not t.isnan().any() for t in state.values())
    return len(state)


def _check(s3: S3, prefix: str, cwd: Path) -> dict:
    return _run(["check", s3.url(prefix)], cwd, f"check_{time.monotonic_ns()}")


def test_a_run_killed_mid_upload_leaves_the_previous_conversion_whole(s3: S3, tmp_path: Path, monkeypatch) -> None:
    first = _run([*FINISHED, "target.world_size=4", f"output.path={s3.url('out')}"], tmp_path, "first")
    assert first["code"] == 0, first["stderr"]
    before = _objects(s3, "out")
    assert "dcp/.metadata" in before and "manifest.json" in before

    killed = _osdpipe([*KILLED, "target.world_size=8", f"output.path={s3.url('out')}", "output.overwrite=true"],
                      tmp_path, tmp_path / "killed")  # fmt: skip
    # killed while the big file goes up in parts (after the ranks' files, which go up as they are written)
    seen = _kill_when(killed, s3, "out", lambda keys: bool(_uploads_in_flight(s3, f"out/{INCOMING}")))
    assert "manifest.json" not in seen, f"the kill landed after the upload ({seen}); the upload was too quick"
    strays = [k.removeprefix(f"out/{INCOMING}/") for k in s3.keys(f"out/{INCOMING}")]
    assert strays and "manifest.json" not in strays
    assert _objects(s3, "out") == before, "the previous conversion was touched before the new one was whole"
    # the big file was going up in parts: S3 keeps (and bills) the parts of an upload neither completed nor aborted
    assert _uploads_in_flight(s3, f"out/{INCOMING}") == [f"out/{INCOMING}/source/optim.pt"]

    check = _check(s3, "out", tmp_path)
    assert check["code"] == 0, check["stdout"] + check["stderr"]
    lines = check["stdout"].splitlines()
    assert lines[0].startswith("  check files      pass  ")
    assert lines[1].startswith(f"  check strays     pass  {len(strays)} stray object(s) an unfinished run left under "
                               f"{s3.url('out', INCOMING)}/: ")  # fmt: skip
    assert all(name in lines[1] for name in strays[:5])
    assert lines[-1] == f"osdpipe check: OK  {s3.url('out')}"
    assert _world(s3, "out") == 4
    assert _loads_with_pytorchs_reader(s3, "out", monkeypatch, tmp_path) > 0

    third = _run([*FINISHED, "target.world_size=8", f"output.path={s3.url('out')}", "output.overwrite=true"],
                 tmp_path, "third")  # fmt: skip
    assert third["code"] == 0, third["stderr"]
    assert (
        f"removed {len(strays)} stray object(s) an unfinished run left under {s3.url('out', INCOMING)}/"
        in (third["stderr"])
    )
    assert (
        f"aborted 1 unfinished multipart upload(s) an unfinished run left under {s3.url('out')}/: "
        f"{INCOMING}/source/optim.pt" in third["stderr"]
    )
    assert s3.keys(f"out/{INCOMING}") == [] and _uploads_in_flight(s3, "out") == []
    assert _world(s3, "out") == 8
    after = _check(s3, "out", tmp_path)
    assert after["code"] == 0 and f"nothing under {s3.url('out', INCOMING)}/" in after["stdout"], after["stdout"]
    assert _loads_with_pytorchs_reader(s3, "out", monkeypatch, tmp_path) > 0


def test_a_run_killed_while_committing_is_finished_by_the_next(s3: S3, tmp_path: Path, monkeypatch) -> None:
    first = _run([*FINISHED, "target.world_size=4", f"output.path={s3.url('out')}"], tmp_path, "first")
    assert first["code"] == 0, first["stderr"]

    killed = _osdpipe([*KILLED, "target.world_size=8", f"output.path={s3.url('out')}", "output.overwrite=true"],
                      tmp_path, tmp_path / "killed")  # fmt: skip
    _kill_when(killed, s3, "out", lambda keys: "manifest.json" in keys)
    copying = _uploads_in_flight(s3, "out")  # the commit copies a large object into place in parts
    incoming = [k.removeprefix(f"out/{INCOMING}/") for k in s3.keys(f"out/{INCOMING}")]
    assert "manifest.json" in incoming and "dcp/.metadata" in incoming, "the kill landed after the commit"

    check = _check(s3, "out", tmp_path)
    said = check["stdout"] + check["stderr"]
    assert "  check files      pass  " in said, said  # the old conversion's files, or the new one's under .incoming/
    if "out/manifest.json" in s3.keys("out"):  # killed before the commit's first step: the old conversion in place
        assert check["code"] == 0 and _world(s3, "out") == 4, said
        assert f"check strays     pass  a run was killed while committing into {s3.url('out')}: " in said, said
    else:  # the old markers gone: no reader takes the prefix for a conversion; check says why and what finishes it
        assert check["code"] == 1, said
        assert (
            f"check commit     FAIL  a run was killed while committing into {s3.url('out')}: the prefix holds "
            "no whole conversion until the next run into it" in said
        ), said
    assert _loads_with_pytorchs_reader(s3, f"out/{INCOMING}", monkeypatch, tmp_path) > 0  # the new one, whole

    third = _run([*FINISHED, "target.world_size=8", f"output.path={s3.url('out')}", "output.overwrite=true"],
                 tmp_path, "third")  # fmt: skip
    assert third["code"] == 0, third["stderr"]
    assert f"finished committing into {s3.url('out')}" in third["stderr"]
    if copying:
        assert f"aborted {len(copying)} unfinished multipart upload(s) an unfinished run left under " in third["stderr"]
    assert s3.keys(f"out/{INCOMING}") == [] and _uploads_in_flight(s3, "out") == []
    assert _world(s3, "out") == 8
    after = _check(s3, "out", tmp_path)
    assert after["code"] == 0 and f"nothing under {s3.url('out', INCOMING)}/" in after["stdout"], after["stdout"]
    assert _loads_with_pytorchs_reader(s3, "out", monkeypatch, tmp_path) > 0


def test_a_run_killed_writing_into_an_empty_prefix_leaves_no_marker_and_the_next_removes_it(
    s3: S3, tmp_path: Path, monkeypatch
) -> None:
    killed = _osdpipe([*KILLED, "target.world_size=4", f"output.path={s3.url('out')}"], tmp_path,
                      tmp_path / "killed")  # fmt: skip
    seen = _kill_when(killed, s3, "out", lambda keys: any(not k.startswith(INCOMING + "/") for k in keys), under="")
    assert any(k.startswith(f"{INCOMING}/writing/") for k in seen), seen  # a note naming its files went first
    left = [k.removeprefix("out/") for k in s3.keys("out")]
    assert "manifest.json" not in left and "dcp/.metadata" not in left, f"a marker before its data: {left}"
    assert all(k.startswith(f"{INCOMING}/writing/") for k in left if k.startswith(INCOMING + "/"))  # nothing staged
    written = [k for k in left if not k.startswith(INCOMING + "/")]
    assert written

    check = _check(s3, "out", tmp_path)
    assert check["code"] == 1, check["stdout"] + check["stderr"]
    assert f"check commit     FAIL  a run was killed while writing a conversion into {s3.url('out')}, which held " in (
        check["stdout"]
    ), check["stdout"]
    copying = _uploads_in_flight(s3, "out")
    # listed again: a PUT whose body had reached the server when the run was killed may complete after the kill
    written = [k.removeprefix("out/") for k in s3.keys("out") if not k.startswith(f"out/{INCOMING}/")]

    third = _run([*FINISHED, "target.world_size=8", f"output.path={s3.url('out')}"], tmp_path, "third")
    assert third["code"] == 0, third["stderr"]  # no overwrite needed: the prefix held no conversion
    assert (
        f"removed {len(written)} object(s) of an unfinished conversion that a run killed while writing it into "
        f"{s3.url('out')} left" in third["stderr"]
    ), third["stderr"]
    if copying:
        assert f"aborted {len(copying)} unfinished multipart upload(s) an unfinished run left under " in third["stderr"]
    assert s3.keys(f"out/{INCOMING}") == [] and _uploads_in_flight(s3, "out") == []
    assert _world(s3, "out") == 8
    after = _check(s3, "out", tmp_path)
    assert after["code"] == 0 and f"nothing under {s3.url('out', INCOMING)}/" in after["stdout"], after["stdout"]
    assert _loads_with_pytorchs_reader(s3, "out", monkeypatch, tmp_path) > 0
