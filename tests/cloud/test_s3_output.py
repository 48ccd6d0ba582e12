"""``output.path=s3://bucket/prefix``: the ``osdpipe`` command converts, uploads and commits whole into a real S3 server
(tests/cloud/conftest.py), byte for byte what the same conversion writes on the local disk.

One subprocess runs every conversion of the module (tests/support/cli_driver.py: the command's entry point, once per
case); the tests then look at the bucket.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from cloudenv import ACCESS_KEY, S3, SECRET_KEY, aws_environment, bucket_with_a_users_job
from helpers import run_cli_cases, run_command, run_with_terminal_stderr, user_env

from osdpipe.io import remote_output, store
from osdpipe.io.output import OutputError

TIMEOUT_S = 120
FORMATS = {
    "rank_local": ["target.world_size=3"],
    "fsdp_full": ["target.world_size=2", "output.format=fsdp_full"],
    "dcp": ["target.kind=fsdp2", "target.world_size=3", "output.format=dcp"],
}
RECORDS = ("manifest.json", "report.json", "osdpipe.log")


@pytest.fixture(scope="module")
def converted(s3_endpoint: str, tmp_path_factory) -> tuple[S3, Path, list[dict]]:
    """Each format converted offline twice from one user's job: into ``<root>/local/<fmt>`` and into
    ``s3://<bucket>/<fmt>``."""
    root = tmp_path_factory.mktemp("s3_output")
    with pytest.MonkeyPatch.context() as monkeypatch:
        bucket = bucket_with_a_users_job(monkeypatch, s3_endpoint, root)
        source = ["model.factory=userlm:build", f"input.path={root / 'optim.pt'}", "source.world_size=1",
                  "runtime.mode=offline"]  # fmt: skip
        cases = [
            [*source, *args, f"output.path={where}"]
            for fmt, args in FORMATS.items()
            for where in (root / "local" / fmt, bucket.url(fmt))
        ]
        results = run_cli_cases(cases, cwd=root, per_case_s=TIMEOUT_S, env=user_env())
    return bucket, root, results


def _data(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if Path(name).name not in RECORDS}


def _local_files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def _remote_files(bucket: S3, prefix: str) -> dict[str, bytes]:
    fs = bucket.fs()
    return {key[len(prefix) + 1 :]: fs.cat_file(f"{bucket.bucket}/{key}") for key in bucket.keys(prefix)}


def test_every_conversion_ran(converted) -> None:
    _, _, results = converted
    for result in results:
        assert result["code"] == 0, result["stderr"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_lands_in_s3_byte_for_byte_the_local_conversion(converted, fmt: str) -> None:
    bucket, root, _ = converted
    local, remote = _local_files(root / "local" / fmt), _remote_files(bucket, fmt)
    assert set(remote) == set(local), "the prefix holds the conversion, its manifest, report and log; nothing else"
    assert _data(remote) == _data(local)
    assert _data(remote)
    local_manifest, remote_manifest = json.loads(local["manifest.json"]), json.loads(remote["manifest.json"])
    assert remote_manifest["content_sha256"] == local_manifest["content_sha256"]
    assert remote_manifest["files"] == local_manifest["files"]
    assert remote_manifest["config"]["output"]["path"] == bucket.url(fmt)
    assert json.loads(remote["report.json"])["ok"] is True


def test_the_local_job_directory_keeps_the_record_not_the_conversion(converted) -> None:
    _, root, results = converted
    # one job directory per run, but runs that start in the same second share Hydra's outputs/<date>/<time>
    jobs = [p.parent for p in root.glob("outputs/*/*/report.json")]
    assert 1 <= len(jobs) <= len(FORMATS), jobs
    for job in jobs:
        assert sorted(p.name for p in job.iterdir()) == ["osdpipe.log", "report.json"]
    summaries = [r["stdout"] for r in results[1::2]]
    assert all("s3://" in s for s in summaries), summaries


def test_a_dcp_output_loads_with_pytorchs_own_fsspec_reader(converted, monkeypatch, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    bucket, root, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)  # the reader finds the server as a user's job would
    local_meta = FileSystemReader(str(root / "local" / "dcp" / "dcp")).read_metadata()
    remote_meta = FsspecReader(bucket.url("dcp", "dcp")).read_metadata()
    assert remote_meta.state_dict_metadata.keys() == local_meta.state_dict_metadata.keys()
    key = next(k for k, v in local_meta.state_dict_metadata.items() if hasattr(v, "size") and v.size.numel() > 1)
    want, got = ({key: torch.empty(local_meta.state_dict_metadata[key].size)} for _ in range(2))
    dcp.load(want, storage_reader=FileSystemReader(str(root / "local" / "dcp" / "dcp")), no_dist=True)
    dcp.load(got, storage_reader=FsspecReader(bucket.url("dcp", "dcp")), no_dist=True)
    assert torch.equal(got[key], want[key])


def test_no_credential_is_written_anywhere(converted) -> None:
    bucket, root, results = converted
    written = [p.read_bytes() for p in root.rglob("*") if p.is_file() and p.suffix != ".pt"]
    written += [data for fmt in FORMATS for name, data in _remote_files(bucket, fmt).items() if name in RECORDS]
    written += [(r["stdout"] + r["stderr"]).encode() for r in results]
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert not [w for w in written if secret.encode() in w]


# ------------------------------------------------------------------ the prefix's life: refused, overwritten, recovered


def _source(tmp_path: Path) -> Path:
    """The optimizer state of one step of the test's own model (tests/support/userlm.py), saved once per test."""
    import userlm

    if not (tmp_path / "optim.pt").exists():
        torch.manual_seed(0)
        model = userlm.build()
        torch.save(userlm.fqn_keyed(model, userlm.train(model, steps=1)), tmp_path / "optim.pt")
    return tmp_path / "optim.pt"


def _convert(s3: S3, tmp_path: Path, *extra: str) -> dict:
    args = ["model.factory=userlm:build", f"input.path={_source(tmp_path)}", "source.world_size=1",
            "runtime.mode=offline", *extra]  # fmt: skip
    [result] = run_cli_cases([args], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    return result


def test_a_prefix_holding_a_conversion_is_refused_then_overwritten_whole(s3: S3, tmp_path: Path) -> None:
    first = _convert(s3, tmp_path, "target.world_size=3", f"output.path={s3.url('out')}")
    assert first["code"] == 0, first["stderr"]
    assert "out/rank_2.pt" in s3.keys()
    again = _convert(s3, tmp_path, "target.world_size=2", f"output.path={s3.url('out')}")
    assert again["code"] == 2
    assert again["stderr"].strip().splitlines() == [
        f"osdpipe: error: config: output.path='{s3.url('out')}' already holds a conversion (manifest.json, rank_0.pt, "
        "rank_1.pt); choose another path or set output.overwrite=true"
    ]
    replaced = _convert(s3, tmp_path, "target.world_size=2", f"output.path={s3.url('out')}", "output.overwrite=true")
    assert replaced["code"] == 0, replaced["stderr"]
    assert s3.keys("out") == [f"out/{n}" for n in ("manifest.json", "osdpipe.log", "rank_0.pt", "rank_1.pt",
                                                   "report.json")]  # fmt: skip
    manifest = json.loads(s3.fs().cat_file(f"{s3.bucket}/out/manifest.json"))
    assert manifest["config"]["target"]["world_size"] == 2


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_terminal_is_shown_the_bytes_of_the_upload_left_after_the_ranks(s3: S3, tmp_path: Path, mode: str) -> None:
    """In a user's shell the ranks' files still going up once the last rank converted are a phase of the live line,
    with their bytes: the tail of a large upload is not a silent wait. Offline one process plays every rank and draws
    their files; online each rank sends its own, and rank 0's are drawn (sent to the launcher)."""
    env = {k: v for k, v in user_env().items() if k != "CI"}
    args = ["model.factory=userlm:build", f"input.path={_source(tmp_path)}", "source.world_size=1",
            f"runtime.mode={mode}", "target.world_size=2", f"output.path={s3.url('out')}"]  # fmt: skip
    code, shown = run_with_terminal_stderr(args, tmp_path, env, TIMEOUT_S)
    assert code == 0, shown
    played = range(2) if mode == "offline" else [0]
    whose = "the ranks'" if mode == "offline" else "rank 0's"
    phase = f"osdpipe: uploading {whose} files to {s3.url('out')}"
    assert phase in shown, shown
    total = sum(s3.fs().size(f"{s3.bucket}/out/rank_{r}.pt") for r in played)
    tail = shown[shown.index(phase) : shown.index("osdpipe: uploading to")]  # up to publish's own line
    drawn = re.findall(r"(\d+(?:\.\d+)?)([kMG]?)/(\d+(?:\.\d+)?)([kMG]?) \[", tail)  # tqdm's "7.43k/7.43k ["
    assert drawn, shown
    done, done_unit, whole, whole_unit = drawn[-1]  # the last drawn: every byte of the ranks' files
    assert (done, done_unit) == (whole, whole_unit), drawn
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}[whole_unit]
    assert abs(float(whole) * scale - total) <= 0.01 * total, (drawn, total)


def test_a_sweep_into_s3_commits_each_job_and_summarizes_them_from_their_local_records(s3: S3, tmp_path: Path) -> None:
    """A sweep (Hydra multirun) whose jobs write into object storage: each job commits its conversion to its own
    prefix, and the summary reads each job's report.json where the job made it, in its local directory (it said
    "failed: no report.json" of jobs that had converted and committed, looking for it at the URL)."""
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "model.factory=userlm:build", f"input.path={_source(tmp_path)}", "source.world_size=1",
            "runtime.mode=offline", "target.world_size=2,3", f"output.path={s3.url('sweep')}" + "_${target.world_size}",
            f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    done = run_command([sys.executable, "-m", "osdpipe", *args], cwd=tmp_path, timeout=2 * TIMEOUT_S, env=user_env())
    assert done.returncode == 0, done.stderr[-2000:]
    for world in (2, 3):
        assert f"sweep_{world}/manifest.json" in s3.keys(f"sweep_{world}")
        assert f"sweep_{world}/rank_{world - 1}.pt" in s3.keys(f"sweep_{world}")
    rows = json.loads((sweep_dir / "sweep.json").read_text())["rows"]
    assert [row["kind"] for row in rows] == ["ok", "ok"], rows
    assert all(row["stage_seconds"] and row["bytes"] for row in rows), rows
    assert "2 jobs: 2 ok" in done.stdout + done.stderr


def test_a_missing_bucket_is_one_line_and_nothing_is_written(s3: S3, tmp_path: Path) -> None:
    result = _convert(s3, tmp_path, "target.world_size=2", "output.path=s3://osdpipe-no-such-bucket/out")
    assert result["code"] == 2
    assert result["stderr"].strip().splitlines() == [
        "osdpipe: error: output.path='s3://osdpipe-no-such-bucket/out': no such bucket 'osdpipe-no-such-bucket' "
        f"at the endpoint {s3.endpoint}; check its name and the endpoint"
    ]
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("*.pt"))


def _staged(tmp_path: Path, world: int) -> Path:
    """A committed local conversion of ``world`` rank files, as publish finds one."""
    directory = tmp_path / f"staged_{world}"
    directory.mkdir()
    files = {f"rank_{r}.pt": f"new rank {r}".encode() for r in range(world)}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    (directory / "manifest.json").write_text(json.dumps({"files": {n: "x" for n in files}, "config": {}}))
    return directory


def test_a_run_killed_mid_upload_leaves_the_previous_conversion_and_the_next_run_names_the_strays(s3: S3, tmp_path):
    destination = remote_output.prepare(s3.url("out"), overwrite=False)
    remote_output.publish(destination, _staged(tmp_path, 3))
    before = _remote_files(s3, "out")
    fs = s3.fs()
    fs.pipe(f"{s3.bucket}/out/.incoming/rank_0.pt", b"half of a new conversion")  # killed before its manifest
    assert _remote_files(s3, "out")["rank_0.pt"] == b"new rank 0"
    again = remote_output.prepare(s3.url("out"), overwrite=True)
    assert again.notes == [
        f"removed 1 stray object(s) an unfinished run left under {s3.url('out', '.incoming')}/: rank_0.pt"
    ]
    assert _remote_files(s3, "out") == before


def test_a_run_killed_while_committing_is_finished_by_the_next(s3: S3, tmp_path: Path) -> None:
    destination = remote_output.prepare(s3.url("out"), overwrite=False)
    remote_output.publish(destination, _staged(tmp_path, 3))
    new = _staged(tmp_path, 2)
    fs = s3.fs()
    for path in new.iterdir():  # the upload finished, manifest last; the run died before the commit's first step
        fs.pipe(f"{s3.bucket}/out/.incoming/{path.name}", path.read_bytes())
    fs.rm(f"{s3.bucket}/out/manifest.json")  # ... or during it: the previous markers gone
    again = remote_output.prepare(s3.url("out"), overwrite=True)
    assert again.notes and again.notes[0].startswith("finished committing into")
    assert s3.keys("out") == ["out/manifest.json", "out/rank_0.pt", "out/rank_1.pt"]
    assert _remote_files(s3, "out")["rank_1.pt"] == b"new rank 1"


def _refuse_the_manifest(destination, s3: S3, seen: list[str]) -> None:
    """The store refuses the manifest, the upload's last object; what the prefix holds then goes into ``seen``."""
    pipe_file = destination.fs.pipe_file

    def refused(path: str, data: bytes, **kwargs) -> None:
        if not path.endswith("/manifest.json"):
            return pipe_file(path, data, **kwargs)
        seen.extend(s3.keys("out"))
        raise PermissionError(f"Access Denied on {path}")

    destination.fs.pipe_file = refused


def test_the_markers_go_last_and_a_failed_upload_removes_what_it_uploaded(s3: S3, tmp_path: Path) -> None:
    assert remote_output.markers_last(["manifest.json", "dcp/.metadata", "dcp/__0_0.distcp", "rank_0.pt"]) == [
        "dcp/__0_0.distcp", "rank_0.pt", "dcp/.metadata", "manifest.json"
    ]  # fmt: skip
    remote_output.publish(remote_output.prepare(s3.url("out"), overwrite=False), _staged(tmp_path, 3))
    before = _remote_files(s3, "out")
    destination = remote_output.prepare(s3.url("out"), overwrite=True)  # over a conversion: staged under .incoming/
    seen: list[str] = []
    _refuse_the_manifest(destination, s3, seen)
    with pytest.raises(OutputError) as caught:
        remote_output.publish(destination, _staged(tmp_path, 2))
    assert str(caught.value) == (
        f"output.path='{s3.url('out')}': access denied; the credentials in use may not write here"
    )
    assert [k for k in seen if "/.incoming/" in k] == ["out/.incoming/rank_0.pt", "out/.incoming/rank_1.pt"]
    assert _remote_files(s3, "out") == before


def test_into_an_empty_prefix_each_file_goes_straight_to_its_key_markers_last(s3: S3, tmp_path: Path) -> None:
    """No staging under .incoming/ and no server-side copy: the note naming the files, the data, the DCP metadata,
    the manifest, in that order; then the note is gone."""
    directory = _staged(tmp_path, 2)
    (directory / "dcp").mkdir()
    (directory / "dcp" / "__0_0.distcp").write_bytes(b"items")
    (directory / "dcp" / ".metadata").write_bytes(b"metadata")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"].update({"dcp/__0_0.distcp": "x", "dcp/.metadata": "x"})
    (directory / "manifest.json").write_text(json.dumps(manifest))
    destination = remote_output.prepare(s3.url("out"), overwrite=False)
    fs, written = destination.fs, []
    put, put_file, pipe_file = fs.put, fs.put_file, fs.pipe_file

    def copy(*args, **kwargs):
        raise AssertionError("no server-side copy into an empty prefix")

    fs.put = lambda sources, keys, **kw: (written.extend(keys), put(sources, keys, **kw))
    fs.put_file = lambda source, key, **kw: (written.append(key), put_file(source, key, **kw))
    fs.pipe_file = lambda key, data, **kw: (written.append(key), pipe_file(key, data, **kw))
    fs.copy = copy
    shown: list[tuple[int, int]] = []
    total = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())  # the conversion alone
    names = remote_output.publish(destination, directory, lambda done, total: shown.append((done, total)))
    assert shown and shown[-1] == (total, total) and shown == sorted(shown), shown  # every byte, counted up
    top = f"{s3.bucket}/out"
    assert [_note_as_one(k.removeprefix(top + "/")) for k in written] == [
        ".incoming/writing/<note>", "dcp/__0_0.distcp", "rank_0.pt", "rank_1.pt", "dcp/.metadata", "manifest.json",
        "report.json", "osdpipe.log",
    ][: len(written)]  # fmt: skip
    assert names == ["dcp/__0_0.distcp", "rank_0.pt", "rank_1.pt", "dcp/.metadata", "manifest.json"]
    assert s3.keys("out") == [f"out/{n}" for n in sorted(names)]  # nothing under .incoming/
    assert _remote_files(s3, "out")["dcp/__0_0.distcp"] == b"items"


@pytest.mark.parametrize("budget", [None, 40 << 20])
def test_under_a_memory_budget_a_file_goes_up_in_parts_it_bounds(s3: S3, tmp_path: Path, budget) -> None:
    """``runtime.memory_budget`` bounds what an upload holds: a 12 MiB file goes up in parts of an eighth of the budget
    (here S3's smallest, 5 MiB), counted as each is sent; without a budget s3fs reads it whole (a file under two of
    its 50 MiB parts) and sends it in one request."""
    directory = _staged(tmp_path, 1)
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    (directory / "rank_0.pt").write_bytes(data)
    destination = remote_output.prepare(s3.url("out"), overwrite=False, memory_budget=budget)
    shown: list[tuple[int, int]] = []
    remote_output.publish(destination, directory, lambda done, total: shown.append((done, total)))
    steps = [b - a for (a, _), (b, _) in zip([(0, 0), *shown], shown)]
    assert _remote_files(s3, "out")["rank_0.pt"] == data
    if budget is None:
        assert 12 << 20 in steps, steps
    else:
        assert max(steps) <= 5 << 20 and sum(steps) >= 12 << 20, steps


def test_a_failed_write_into_an_empty_prefix_removes_what_it_wrote(s3: S3, tmp_path: Path) -> None:
    destination = remote_output.prepare(s3.url("out"), overwrite=False)
    seen: list[str] = []
    _refuse_the_manifest(destination, s3, seen)
    with pytest.raises(OutputError, match="access denied"):
        remote_output.publish(destination, _staged(tmp_path, 2))
    assert [_note_as_one(k) for k in seen] == ["out/.incoming/writing/<note>", "out/rank_0.pt", "out/rank_1.pt"]
    assert s3.keys("out") == []


def _note_as_one(key: str) -> str:
    """``key`` with a note's name (a random one) said as ``<note>``."""
    return re.sub(r"/\.incoming/writing/[0-9a-f]{32}\.json$", "/.incoming/writing/<note>", "/" + key)[1:]


def _killed_writing(s3: S3, tmp_path: Path, written: list[str]) -> list[str]:
    """The prefix as a run writing straight into it leaves it when killed after ``written`` (in upload order)."""
    directory = _staged(tmp_path, 3)
    names = remote_output.markers_last([p.name for p in directory.iterdir()])
    fs = s3.fs()
    fs.pipe(f"{s3.bucket}/out/.incoming/writing/{'0' * 32}.json", json.dumps({"files": names[:2]}).encode())
    fs.pipe(f"{s3.bucket}/out/.incoming/writing/{'1' * 32}.json", json.dumps({"files": names[2:]}).encode())
    for name in written:
        fs.pipe(f"{s3.bucket}/out/{name}", (directory / name).read_bytes())
    return names


def test_a_run_killed_writing_into_an_empty_prefix_is_named_by_check_and_removed_by_the_next(s3: S3, tmp_path):
    _killed_writing(s3, tmp_path, ["rank_0.pt", "rank_1.pt"])  # before its manifest
    [check] = run_cli_cases([["check", s3.url("out")]], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    assert check["code"] == 1, check["stdout"] + check["stderr"]
    assert (
        f"check commit     FAIL  a run was killed while writing a conversion into {s3.url('out')}, which held none: "
        "2 of its 4 file(s) are there (rank_0.pt, rank_1.pt), no manifest" in check["stdout"]
    ), check["stdout"]
    again = remote_output.prepare(s3.url("out"), overwrite=False)  # no conversion there: no overwrite needed
    assert again.notes == [
        f"removed 2 object(s) of an unfinished conversion that a run killed while writing it into {s3.url('out')} "
        "left (no manifest; no reader took them for a conversion): rank_0.pt, rank_1.pt"
    ]
    assert s3.keys("out") == []


def test_a_run_killed_after_its_manifest_leaves_its_conversion_whole(s3: S3, tmp_path: Path) -> None:
    names = _killed_writing(s3, tmp_path, [])
    for name in names:
        s3.fs().pipe(f"{s3.bucket}/out/{name}", (tmp_path / "staged_3" / name).read_bytes())
    with pytest.raises(OutputError, match="already holds a conversion"):
        remote_output.prepare(s3.url("out"), overwrite=False)
    assert s3.keys("out") == [f"out/{n}" for n in sorted(names)]  # the note gone, the conversion kept


def test_a_prefix_that_cannot_be_written_is_refused_before_the_run(s3: S3, monkeypatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(OutputError, match="^output.path='s3://[^']+/out': no S3 credentials found; set "):
        remote_output.prepare(s3.url("out"), overwrite=False)
    assert store.is_remote(s3.url("out"))


def test_check_proves_each_format_in_s3_against_its_source_and_sees_one_element_differ(
    converted, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``osdpipe check s3://...`` runs ``roundtrip`` on the files in the bucket: each target rank's state derived from
    the source again and held against what the bucket holds (DCP items by range, ``torch.save`` files by their
    records); given a source with one element changed (``input.path=``), it fails naming the tensor."""
    bucket, root, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    state = torch.load(root / "optim.pt", weights_only=True)
    first = next(iter(state["state"]))
    state["state"][first]["exp_avg"].view(-1)[0] += 1
    torch.save(state, root / "one_off.pt")
    cases = [["check", bucket.url(fmt)] for fmt in sorted(FORMATS)]
    cases += [["check", bucket.url(fmt), f"input.path={root / 'one_off.pt'}"] for fmt in sorted(FORMATS)]
    results = run_cli_cases(cases, cwd=root, per_case_s=TIMEOUT_S, env=user_env())
    for fmt, same, other in zip(sorted(FORMATS), results, results[len(FORMATS) :], strict=False):
        assert same["code"] == 0, (fmt, same["stdout"] + same["stderr"])
        assert "check roundtrip  pass" in same["stdout"] and str(root / "optim.pt") in same["stdout"], same["stdout"]
        assert other["code"] == 1, (fmt, other["stdout"] + other["stderr"])
        assert "check roundtrip  FAIL" in other["stdout"] and "exp_avg" in other["stdout"], other["stdout"]


def test_check_load_loads_a_conversion_in_s3_on_its_target_world(
    converted, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``osdpipe check s3://... --load``: the files copied into a temporary directory (``TMPDIR``), loaded there on the
    target world and stepped as a local conversion's are, the copy removed after; each format."""
    bucket, root, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    # short: the target world's processes put their sockets under TMPDIR, and an AF_UNIX path holds 107 bytes at most
    # (pytest's own tmp_path under xdist, pytest-<N>/popen-gw<i>/<test name>, comes within a few bytes of it)
    scratch = Path(tempfile.mkdtemp(prefix="ck-"))
    worlds = {"rank_local": "3 fsdp1", "fsdp_full": "2 fsdp1", "dcp": "3 fsdp2"}
    try:
        results = run_cli_cases([["check", bucket.url(fmt), "--load"] for fmt in sorted(FORMATS)], cwd=root,
                                per_case_s=TIMEOUT_S, env=user_env(TMPDIR=str(scratch)))  # fmt: skip
        left = [p for p in scratch.iterdir() if p.name.startswith("osdpipe-check-load-")]
    finally:
        shutil.rmtree(scratch)
    for fmt, result in zip(sorted(FORMATS), results, strict=True):
        assert result["code"] == 0, (fmt, result["stdout"] + result["stderr"])
        said = result["stdout"]
        assert f"check load       pass  on {worlds[fmt]} rank(s): loaded; one step left all state finite" in said, said
        assert f"check resume     pass  on {worlds[fmt]} rank(s)" in said, said
        assert said.splitlines()[-1] == f"osdpipe check: OK  {bucket.url(fmt)}"
    assert not left


def test_check_load_of_s3_loads_what_the_bucket_holds(converted, s3: S3, tmp_path: Path) -> None:
    """The copy ``--load`` loads is the bucket's: rank 1's file there holding a NaN fails ``load``, naming rank 1."""
    bucket, _, _ = converted
    fs = bucket.fs()
    for key in bucket.keys("rank_local"):
        fs.copy(f"{bucket.bucket}/{key}", f"{s3.bucket}/{key}")
    osd = torch.load(io.BytesIO(fs.cat_file(f"{bucket.bucket}/rank_local/rank_1.pt")), weights_only=True)
    key = sorted(k for k, st in osd["state"].items() if isinstance(st, dict) and st["exp_avg_sq"].numel() > 3)[0]
    osd["state"][key]["exp_avg_sq"].view(-1)[2] = float("nan")
    changed = io.BytesIO()
    torch.save(osd, changed)
    s3.fs().pipe(f"{s3.bucket}/rank_local/rank_1.pt", changed.getvalue())
    [result] = run_cli_cases([["check", s3.url("rank_local"), "--load"]], cwd=tmp_path, per_case_s=TIMEOUT_S,
                             env=user_env())  # fmt: skip
    assert result["code"] == 1, result["stdout"] + result["stderr"]
    line = next(line for line in result["stdout"].splitlines() if "check load" in line)
    assert "FAIL  rank 1: non-finite in the loaded state" in line and "exp_avg_sq (1 element)" in line, line


def test_a_file_the_manifest_lists_that_another_process_sent_is_published_and_one_it_did_not_send_fails(
    s3: S3, tmp_path: Path
) -> None:
    """Under torchrun rank 0 holds its own files and the manifest; the others' files are in the prefix, sent by their
    processes: publish commits them with the rest. One that is in neither place fails the publish, and what was sent
    is removed."""
    sent = _staged(tmp_path, 3)
    destination = remote_output.prepare(s3.url("out"), overwrite=False)
    remote_output.send(destination, sent, ["rank_2.pt"])  # another process's file, sent as it was written
    (sent / "rank_2.pt").unlink()  # ... from that process's own directory
    assert remote_output.publish(destination, sent) == ["rank_0.pt", "rank_1.pt", "rank_2.pt", "manifest.json"]
    assert s3.keys("out") == [f"out/{n}" for n in ("manifest.json", "rank_0.pt", "rank_1.pt", "rank_2.pt")]
    assert _remote_files(s3, "out")["rank_2.pt"] == b"new rank 2"

    unsent = _staged(tmp_path, 4)
    (unsent / "rank_3.pt").unlink()  # listed by the manifest, sent by nobody
    destination = remote_output.prepare(s3.url("lost"), overwrite=False)
    with pytest.raises(OutputError) as caught:
        remote_output.publish(destination, unsent)
    assert str(caught.value) == (
        f"output.path='{s3.url('lost')}': 1 file(s) of the conversion are neither in {unsent} nor in the prefix "
        "(rank_3.pt); the processes that wrote them did not send them: run the conversion again"
    )
    assert s3.keys("lost") == []


@pytest.mark.parametrize("over_a_conversion", [False, True])
def test_a_process_whose_run_failed_withdraws_what_its_queue_sent(s3: S3, tmp_path: Path, over_a_conversion) -> None:
    """Each process removes its own sends once nothing of its is in flight: under torchrun the launcher's discard is
    rank 0's, and an upload of another process still in flight then would land after it. The conversion in place,
    if any, is not touched."""
    from osdpipe.io.upload_queue import UploadQueue

    if over_a_conversion:
        remote_output.publish(remote_output.prepare(s3.url("out"), overwrite=False), _staged(tmp_path, 1))
    before = _remote_files(s3, "out")
    destination = remote_output.prepare(s3.url("out"), overwrite=True)
    assert destination.staged is over_a_conversion
    queue = UploadQueue(destination.upload)
    queue.send(_staged(tmp_path, 3), ["rank_1.pt", "rank_2.pt"])
    assert queue.finish() is None
    sent = [k for k in s3.keys("out") if k.endswith(("rank_1.pt", "rank_2.pt"))]
    assert len(sent) == 2, s3.keys("out")
    queue.withdraw()
    assert not [k for k in s3.keys("out") if k.endswith(("rank_1.pt", "rank_2.pt"))]
    assert {k: v for k, v in _remote_files(s3, "out").items() if not k.startswith(".incoming/")} == before
