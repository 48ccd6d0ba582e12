"""``output.path=s3://...`` under torchrun, on nodes that share no directory.

Two torchrun agents (``--nnodes 2``, one process each, meeting on 127.0.0.1) are started in two directories of their
own: the "nodes" see the bucket and nothing of each other's disk. They read the source from the bucket and write the
conversion into it: each process makes its own ranks' files in its own directory and sends them as they are written;
rank 0 finishes and commits the conversion. What lands in the prefix is byte for byte what the same conversion writes
on one machine's disk; the second node keeps no file, the first only the run's record. A prefix that rank 0 refuses
ends every rank at once, with one line, the prefix untouched; with ``output.overwrite=true`` the new conversion
replaces the old whole (the ranks' files sent under ``.incoming/`` first).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cloudenv import ACCESS_KEY, S3, SECRET_KEY, aws_environment, bucket_with_a_users_job
from helpers import run_cli_cases, torchrun_two_nodes, user_env

TIMEOUT_S = 240
SOURCE = ["model.factory=userlm:build", "source.world_size=1"]
CASES = {
    # the target world itself: one rank a process, every check
    "online-dcp": ["target.kind=fsdp2", "target.world_size=2", "output.format=dcp"],
    # fewer processes than target ranks: each plays a share (runtime.mode=offline)
    "offline-rank_local": ["runtime.mode=offline", "target.world_size=3"],
}
RECORDS = ("manifest.json", "report.json", "osdpipe.log")


def _nodes(root: Path, name: str) -> tuple[Path, Path]:
    """The two nodes' directories of the run ``name`` (made on first use)."""
    nodes = (root / name / "node-a", root / name / "node-b")
    for node in nodes:
        node.mkdir(parents=True, exist_ok=True)
    return nodes


def _files_under(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def converted(s3_endpoint: str, tmp_path_factory) -> tuple[S3, Path, dict[str, list[tuple[int, str]]], list[dict]]:
    """Each case converted from the bucket into it by the two nodes (``s3://<bucket>/<case>``), and on one machine
    into ``<root>/local/<case>``."""
    root = tmp_path_factory.mktemp("s3_torchrun")
    with pytest.MonkeyPatch.context() as monkeypatch:
        bucket = bucket_with_a_users_job(monkeypatch, s3_endpoint, root)
        bucket.fs().put_file(str(root / "optim.pt"), f"{bucket.bucket}/source/optim.pt")
        local = run_cli_cases(
            [[*SOURCE, *args, f"input.path={root / 'optim.pt'}", f"output.path={root / 'local' / case}"]
             for case, args in CASES.items()],
            cwd=root, per_case_s=TIMEOUT_S, env=user_env(),
        )  # fmt: skip
        agents = {
            case: torchrun_two_nodes(
                [*SOURCE, *args, f"input.path={bucket.url('source', 'optim.pt')}", f"output.path={bucket.url(case)}"],
                _nodes(root, case), user_env(), TIMEOUT_S,
            )  # fmt: skip
            for case, args in CASES.items()
        }
    return bucket, root, agents, local


def _remote_files(bucket: S3, prefix: str) -> dict[str, bytes]:
    fs = bucket.fs()
    return {key[len(prefix) + 1 :]: fs.cat_file(f"{bucket.bucket}/{key}") for key in bucket.keys(prefix)}


@pytest.mark.parametrize("case", CASES)
def test_two_nodes_without_a_shared_directory_write_the_local_conversion_into_the_prefix(converted, case) -> None:
    bucket, root, agents, local = converted
    assert all(result["code"] == 0 for result in local), local
    for code, said in agents[case]:
        assert code == 0, said
    assert sum(said.count(f"osdpipe: OK  ->  {bucket.url(case)}") for _, said in agents[case]) == 1, agents[case]
    here = root / "local" / case
    mine = {name: (here / name).read_bytes() for name in _files_under(here)}
    theirs = _remote_files(bucket, case)
    assert set(theirs) == set(mine), "the prefix holds the conversion, its manifest, report and log; nothing else"
    data = [name for name in mine if Path(name).name not in RECORDS]
    assert len(data) >= 2 and all(theirs[name] == mine[name] for name in data)
    manifest, expected = json.loads(theirs["manifest.json"]), json.loads(mine["manifest.json"])
    assert manifest["content_sha256"] == expected["content_sha256"]
    assert manifest["files"] == expected["files"]
    assert json.loads(theirs["report.json"])["ok"] is True


@pytest.mark.parametrize("case", CASES)
def test_the_second_node_keeps_nothing_and_the_first_only_the_runs_record(converted, case) -> None:
    _, root, _, _ = converted
    first, second = _nodes(root, case)
    assert _files_under(second) == []
    assert [Path(f).name for f in _files_under(first)] == ["osdpipe.log", "report.json"]


def test_no_credential_is_written_anywhere(converted) -> None:
    bucket, root, agents, _ = converted
    written = [p.read_bytes() for p in root.rglob("*") if p.is_file() and p.suffix != ".pt"]
    written += [_remote_files(bucket, case)[name] for case in CASES for name in RECORDS]
    written += [said.encode() for case in CASES for _, said in agents[case]]
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert not [w for w in written if secret.encode() in w]


def test_a_refused_prefix_ends_every_rank_at_once_then_an_overwrite_replaces_it_whole(
    converted, monkeypatch, tmp_path
) -> None:
    """Rank 0 finds a conversion in the prefix: it says so in one line and every rank ends (the other does not wait
    for it in the world until torchrun stops it); then with output.overwrite=true the other rank's files go under
    .incoming/ and rank 0 copies the conversion into place (the two processes started in one directory this time, as
    on one node: each keeps its files apart, and only the run's record stays)."""
    bucket, root, _, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    source = [*SOURCE, "runtime.mode=offline", f"input.path={bucket.url('source', 'optim.pt')}"]
    into = f"output.path={bucket.url('again')}"
    [first] = run_cli_cases([[*source, "target.world_size=3", into]], cwd=root, per_case_s=TIMEOUT_S, env=user_env())
    assert first["code"] == 0, first["stderr"]
    before = _remote_files(bucket, "again")
    refused = torchrun_two_nodes([*source, "target.world_size=2", into], _nodes(root, "refused"), user_env(), 60)
    assert all(code == 1 for code, _ in refused), refused
    said = [line for _, out in refused for line in out.splitlines() if line.startswith("osdpipe: error:")]
    assert len(said) == 1 and said[0].startswith(
        f"osdpipe: error: stage 'launch' failed on rank 0: output.path='{bucket.url('again')}' already holds a "
        "conversion (manifest.json, rank_0.pt, rank_1.pt); choose another path or set output.overwrite=true"
    ), refused
    assert _remote_files(bucket, "again") == before
    one_node = _nodes(root, "replaced")[0]  # both processes in one directory: they may share a job's directory
    replaced = torchrun_two_nodes(
        [*source, "target.world_size=2", into, "output.overwrite=true"], (one_node, one_node), user_env(), TIMEOUT_S
    )
    assert all(code == 0 for code, _ in replaced), replaced
    assert sorted(Path(f).name for f in _files_under(one_node)) == ["osdpipe.log", "report.json"]
    assert bucket.keys("again") == [f"again/{n}" for n in ("manifest.json", "osdpipe.log", "rank_0.pt", "rank_1.pt",
                                                            "report.json")]  # fmt: skip
    manifest = json.loads(_remote_files(bucket, "again")["manifest.json"])
    assert manifest["config"]["target"]["world_size"] == 2
