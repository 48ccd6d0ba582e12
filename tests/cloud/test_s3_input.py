"""``input.path=s3://bucket/prefix``: a DCP checkpoint in object storage converts by ranged reads, byte for byte as
its local copy does; ``osdpipe inspect`` and ``osdpipe check`` take a URL (tests/cloud/conftest.py's S3 server).

The conversions run through the command's entry point in subprocesses (tests/support/cli_driver.py); what a read
fetches is measured in this process, through :data:`osdpipe.io.remote_input.METER`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from cloudenv import ACCESS_KEY, S3, SECRET_KEY, aws_environment, bucket_with_a_users_job
from helpers import run_cli_cases, user_env

from osdpipe.io import remote_input

TIMEOUT_S = 120
SOURCE = ["model.factory=userlm:build", "source.kind=fsdp2", "source.world_size=4", "runtime.mode=offline"]
TARGET = ["target.world_size=2"]
RECORDS = ("manifest.json", "report.json", "osdpipe.log")


@pytest.fixture(scope="module")
def converted(s3_endpoint: str, tmp_path_factory) -> tuple[S3, Path, dict[str, dict]]:
    """A DCP checkpoint of 4 ranks (osdpipe's own conversion of a user's job) on the local disk and copied into
    ``s3://<bucket>/src/dcp``; then converted to 2 ranks from each, and the commands on URLs run."""
    root = tmp_path_factory.mktemp("s3_input")
    with pytest.MonkeyPatch.context() as monkeypatch:
        bucket = bucket_with_a_users_job(monkeypatch, s3_endpoint, root)
        made = ["model.factory=userlm:build", f"input.path={root / 'optim.pt'}", "source.world_size=1",
                "runtime.mode=offline", "target.kind=fsdp2", "target.world_size=4", "output.format=dcp"]  # fmt: skip
        into_s3 = [*made[:-2], "target.world_size=3", f"output.path={bucket.url('out')}"]
        first = run_cli_cases([[*made, f"output.path={root / 'src'}"], into_s3], cwd=root, per_case_s=TIMEOUT_S,
                              env=user_env())  # fmt: skip
        assert [r["code"] for r in first] == [0, 0], [r["stderr"] for r in first]
        bucket.fs().put(f"{root / 'src' / 'dcp'}/", f"{bucket.bucket}/src/dcp/", recursive=True)
        bucket.fs().pipe(f"{bucket.bucket}/out/.incoming/rank_0.pt", b"half of a killed run's upload")
        cases = {
            "local": [*SOURCE, f"input.path={root / 'src' / 'dcp'}", *TARGET, f"output.path={root / 'from_local'}"],
            "s3": [*SOURCE, f"input.path={bucket.url('src', 'dcp')}", *TARGET, f"output.path={root / 'from_s3'}"],
            "s3_budget": [*SOURCE, f"input.path={bucket.url('src', 'dcp')}", *TARGET, "runtime.memory_budget=64KB",
                          f"output.path={root / 'from_s3_budget'}"],  # fmt: skip
            "missing_key": [*SOURCE, f"input.path={bucket.url('no', 'such')}", *TARGET, f"output.path={root / 'no1'}"],
            "missing_bucket": [*SOURCE, "input.path=s3://osdpipe-no-such-bucket/dcp", *TARGET,
                               f"output.path={root / 'no2'}"],  # fmt: skip
            "inspect": ["inspect", bucket.url("src", "dcp")],
            "inspect_json": ["inspect", bucket.url("src", "dcp"), "--json"],
            "inspect_missing": ["inspect", bucket.url("nothing")],
            "check": ["check", bucket.url("out")],
        }
        fetches = user_env(OSDPIPE_TEST_RECORD_FETCHES=str(root / "fetches.jsonl"))  # see test_..._one_snapshot
        results = run_cli_cases(list(cases.values()), cwd=root, per_case_s=TIMEOUT_S, env=fetches)
    return bucket, root, dict(zip(cases, results, strict=True))


def _data(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file() and p.name not in RECORDS
    }


@pytest.mark.parametrize("case", ["s3", "s3_budget"])
def test_a_dcp_input_in_s3_converts_byte_for_byte_as_its_local_copy(converted, case: str) -> None:
    bucket, root, results = converted
    assert results["local"]["code"] == 0, results["local"]["stderr"]
    assert results[case]["code"] == 0, results[case]["stderr"]
    local, remote = root / "from_local", root / ("from_s3" if case == "s3" else "from_s3_budget")
    assert _data(remote) == _data(local)
    assert _data(local)
    local_manifest, remote_manifest = (json.loads((d / "manifest.json").read_text()) for d in (local, remote))
    assert remote_manifest["content_sha256"] == local_manifest["content_sha256"]
    assert remote_manifest["config"]["input"]["path"] == bucket.url("src", "dcp")
    assert json.loads((remote / "report.json").read_text())["ok"] is True


def test_no_credential_is_written_or_said(converted) -> None:
    _, root, results = converted
    written = [p.read_bytes() for d in ("from_s3", "from_s3_budget") for p in (root / d).rglob("*") if p.is_file()]
    written += [(r["stdout"] + r["stderr"]).encode() for r in results.values()]
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert not [w for w in written if secret.encode() in w]


def test_the_store_clients_chatter_is_not_printed(converted) -> None:
    """botocore says where it found the credentials and the endpoint at INFO, on every run; Hydra's console handler
    printed those lines among osdpipe's own (``[HYDRA] Found credentials in environment variables.``)."""
    _, _, results = converted
    said = "".join(r["stdout"] + r["stderr"] for r in results.values())
    assert "Found credentials" not in said and "Found endpoint" not in said, said[:2000]


def test_a_missing_key_or_bucket_is_one_line_and_nothing_is_written(converted) -> None:
    bucket, root, results = converted
    assert results["missing_key"]["code"] == 2
    assert results["missing_key"]["stderr"].strip().splitlines() == [
        f"osdpipe: error: config: input.path='{bucket.url('no', 'such')}': '{bucket.url('no', 'such')}' does not "
        "exist; check the prefix"
    ]
    assert results["missing_bucket"]["code"] == 2
    assert results["missing_bucket"]["stderr"].strip().splitlines() == [
        "osdpipe: error: config: input.path='s3://osdpipe-no-such-bucket/dcp': no such bucket "
        f"'osdpipe-no-such-bucket' at the endpoint {bucket.endpoint}; check its name and the endpoint"
    ]
    assert not (root / "no1").exists() and not (root / "no2").exists()


def test_inspect_reads_a_url(converted) -> None:
    bucket, root, results = converted
    assert results["inspect"]["code"] == 0, results["inspect"]["stderr"]
    shown = results["inspect"]["stdout"]
    assert shown.splitlines()[0] == bucket.url("src", "dcp")
    assert "format       dcp (key 'optim')" in shown
    assert "world size   4" in shown
    facts = json.loads(results["inspect_json"]["stdout"])
    assert (facts["format"], facts["world_size"], facts["path"]) == ("dcp", 4, bucket.url("src", "dcp"))
    assert f"input.path={bucket.url('src', 'dcp')}" in facts["command"]
    assert results["inspect_missing"]["code"] == 1
    assert results["inspect_missing"]["stderr"].strip().splitlines() == [
        f"osdpipe inspect: error: PATH='{bucket.url('nothing')}': '{bucket.url('nothing')}' does not exist; "
        "check the prefix"
    ]


def test_check_hashes_a_conversion_in_s3_and_names_the_strays(converted) -> None:
    bucket, _, results = converted
    result = results["check"]
    assert result["code"] == 0, result["stderr"]
    lines = result["stdout"].splitlines()
    assert lines[0] == "  check files      pass  3 file(s) match the manifest's digests"
    assert lines[1] == (
        f"  check strays     pass  1 stray object(s) an unfinished run left under {bucket.url('out', '.incoming')}/: "
        "rank_0.pt; they do not touch this conversion, and the next run into the prefix removes them"
    )
    assert lines[-1] == f"osdpipe check: OK  {bucket.url('out')}"


def test_check_finds_an_object_that_differs(converted, s3: S3) -> None:
    bucket, _, _ = converted
    fs = bucket.fs()
    for key in bucket.keys("out"):
        if not key.startswith("out/.incoming"):
            fs.copy(f"{bucket.bucket}/{key}", f"{s3.bucket}/{key}")
    data = bytearray(fs.cat_file(f"{bucket.bucket}/out/rank_1.pt"))
    data[-100] ^= 1
    s3.fs().pipe(f"{s3.bucket}/out/rank_1.pt", bytes(data))
    [result] = run_cli_cases([["check", s3.url("out")]], cwd=Path.cwd(), per_case_s=TIMEOUT_S, env=user_env())
    assert result["code"] == 1
    assert f"check files      FAIL  {s3.url('out', 'rank_1.pt')} differs from its digest in the manifest" in (
        result["stdout"]
    )


def test_a_rank_fetches_only_the_items_it_needs_never_a_whole_file(converted, monkeypatch, tmp_path) -> None:
    from osdpipe.io.formats.dcp_reader import DcpReader

    bucket, root, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    remote_input.configure({})
    url = bucket.url("src", "dcp")
    sizes = {p.name: p.stat().st_size for p in (root / "src" / "dcp").iterdir()}
    remote, local = DcpReader(url, "optim"), DcpReader(str(root / "src" / "dcp"), "optim")
    meta = local.meta()
    assert remote.meta().param_groups == meta.param_groups
    fqn = max(meta.state, key=lambda f: meta.state[f]["exp_avg"].shape[0])
    ref = meta.state[fqn]["exp_avg"]
    rows = ref.shape[0]
    row = int(torch.Size(ref.shape[1:]).numel())
    remote_input.METER.reset()
    got = remote.read_range(fqn, "exp_avg", 0, row)  # target rank 0's first row: in source rank 0's first chunk
    assert torch.equal(got, local.read_range(fqn, "exp_avg", 0, row))
    [(fetched_url, start, end)] = remote_input.METER.ranges  # one ranged request: that chunk's item
    assert fetched_url == f"{url}/__0_0.distcp"
    assert 0 < end - start < sizes["__0_0.distcp"]
    assert rows > 1
    items = [(fqn, "exp_avg"), (fqn, "exp_avg_sq")]
    remote_input.METER.reset()
    whole = remote.read(items)
    expected = local.read(items)
    assert all(torch.equal(whole[k], expected[k]) for k in items)
    distcp = {u.rsplit("/", 1)[-1] for u, _, _ in remote_input.METER.ranges}
    assert remote_input.METER.bytes < sum(sizes[n] for n in distcp)  # the two tensors' items, not their files


def test_the_roundtrip_check_fetches_nothing_from_the_source(converted, monkeypatch, tmp_path) -> None:
    """The roundtrip check compares the output with the sha256 the shard stage took of each batch as it read it
    (``osdpipe.run.stages.shard.digests_reads``): a source in object storage is fetched once, not once to convert and
    once more to check. The same conversion with and without the check makes the same requests (this model's items
    are small: a snapshot would keep them, so here it keeps only what is under 1 KiB, as a large model's)."""
    bucket, _, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    log = tmp_path / "fetches.jsonl"
    env = user_env(OSDPIPE_TEST_RECORD_FETCHES=str(log), OSDPIPE_TEST_SMALL_READ="1024")
    args = [*SOURCE, f"input.path={bucket.url('src', 'dcp')}", *TARGET]
    checked = [*args, "pipeline.checks=[roundtrip]", f"output.path={tmp_path / 'checked'}"]
    unchecked = [*args, "pipeline.checks=[]", f"output.path={tmp_path / 'unchecked'}"]
    results = run_cli_cases([checked, unchecked], cwd=tmp_path, per_case_s=TIMEOUT_S, env=env)
    assert [r["code"] for r in results] == [0, 0], [r["stderr"] for r in results]
    report = json.loads((tmp_path / "checked" / "report.json").read_text())
    assert [c["ok"] for c in report["checks"] if c["name"] == "roundtrip"] == [True], report["checks"]
    fetched = {
        json.loads(line)["argv"][-2]: sorted(map(tuple, json.loads(line)["ranges"]))
        for line in log.read_text().splitlines()
    }
    assert set(fetched) == {"pipeline.checks=[roundtrip]", "pipeline.checks=[]"}, sorted(fetched)
    assert any(end - start > 1024 for _, start, end in fetched["pipeline.checks=[]"])
    assert fetched["pipeline.checks=[roundtrip]"] == fetched["pipeline.checks=[]"]


def test_an_output_made_as_it_is_written_fetches_its_pieces_ahead(converted, monkeypatch, tmp_path) -> None:
    """Under ``runtime.memory_budget`` save makes the output as it writes it (``osdpipe.run.streamed_output``), piece
    by piece; the reader is told every piece first, so a source in object storage is fetched as the same few requests
    as without a budget (neighbours as one, several in flight, within half the budget), not one request per piece
    (91 here before)."""
    bucket, _, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    log = tmp_path / "fetches.jsonl"
    env = user_env(OSDPIPE_TEST_RECORD_FETCHES=str(log), OSDPIPE_TEST_SMALL_READ="1024")
    args = [*SOURCE, f"input.path={bucket.url('src', 'dcp')}", *TARGET, "pipeline.checks=[roundtrip]"]
    budget = [*args, "runtime.memory_budget=1MB", f"output.path={tmp_path / 'budget'}"]
    results = run_cli_cases([budget, [*args, f"output.path={tmp_path / 'held'}"]], cwd=tmp_path,
                            per_case_s=TIMEOUT_S, env=env)  # fmt: skip
    assert [r["code"] for r in results] == [0, 0], [r["stderr"] for r in results]
    [roundtrip] = [c for c in json.loads((tmp_path / "budget" / "report.json").read_text())["checks"]
                   if c["name"] == "roundtrip"]  # fmt: skip
    assert roundtrip["ok"] and "batch by batch as save writes them" in roundtrip["detail"], roundtrip
    fetched = [
        sorted(tuple(r) for r in json.loads(line)["ranges"] if r[0].endswith(".distcp"))
        for line in log.read_text().splitlines()
    ]
    assert len(fetched) == 2 and fetched[0], fetched
    assert fetched[0] == fetched[1], f"{len(fetched[0])} requests under the budget, {len(fetched[1])} without"


def _misfilled(input_path: str, tmp_path: Path) -> str:
    """The error line of the conversion of ``input_path`` to 2 ranks with one element of ``blocks.1.wq.weight``'s
    ``exp_avg`` copied wrong (``tests/support/faults``): the one line, exit 1, and only the failed run's records."""
    out = tmp_path / "out"
    args = [*SOURCE, f"input.path={input_path}", *TARGET, f"output.path={out}"]
    env = user_env(OSDPIPE_TEST_MISFILL="blocks.1.wq.weight:exp_avg")
    [result] = run_cli_cases([args], cwd=tmp_path, per_case_s=TIMEOUT_S, env=env)
    errors = [line for line in result["stderr"].splitlines() if line.startswith("osdpipe: error:")]
    assert result["code"] == 1 and len(errors) == 1, result["stderr"]
    assert sorted(p.name for p in out.iterdir()) == ["osdpipe.log", "report.json"]
    return errors[0]


def test_an_element_converted_wrong_from_s3_fails_the_roundtrip_check(converted, monkeypatch, tmp_path) -> None:
    """The digests taken as the source was read catch one element copied wrong, and name the batch; no checkpoint
    is written."""
    bucket, _, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    error = _misfilled(bucket.url("src", "dcp"), tmp_path)
    said = ("roundtrip", "exp_avg: elements blocks.1.wq.weight[", "differ from what this rank read from the source")
    for word in said:
        assert word in error, f"{word!r} not in {error!r}"


def test_an_element_converted_wrong_from_the_local_copy_is_named(converted, tmp_path) -> None:
    """The same source on the local disk is read again by the roundtrip check, as the stored chunks cut each range
    (4 -> 2: a range spans two or three); the one element copied wrong is named where it lies, and nothing is
    written."""
    _, root, _ = converted
    error = _misfilled(str(root / "src" / "dcp"), tmp_path)
    # the first element of the batch holding it (wrong by one): where target rank 1's rows of the parameter start (the
    # target is the source's FSDP2: 6 x 6, rows 3 to 5 its; the source's ranks hold two rows each, so the range
    # [18, 36) spans two of their chunks)
    assert "rank 1: blocks.1.wq.weight.exp_avg: differs from blocks.1.wq.weight[18] (flat)" in error, error


def test_a_command_reads_its_input_as_one_snapshot(converted) -> None:
    """Working out the config (the input's facts), checking the source and the load stage each open the input; the
    conversion from ``s3://`` lists it and fetches its ``.metadata`` and each small item (steps, param groups) once,
    not once per opening (``remote_input.one_snapshot`` around the command); so does ``osdpipe check`` of a
    conversion in the bucket."""
    _, root, results = converted
    assert results["s3"]["code"] == 0, results["s3"]["stderr"]
    [ranges] = [
        line["ranges"]
        for line in map(json.loads, (root / "fetches.jsonl").read_text().splitlines())
        if any(a.startswith("input.path=s3://") and a.endswith("/src/dcp") for a in line["argv"])
        and not any(a.startswith("runtime.memory_budget") for a in line["argv"])
    ]
    small = [tuple(r) for r in ranges if r[2] - r[1] <= remote_input.SMALL_READ]
    assert [r for r in small if r[0].endswith("/.metadata")] == [small[0]]  # read first, and once
    assert len(small) == len(set(small)) > 1, "a small range fetched twice in one command"
    # osdpipe check of the conversion in the bucket: its roundtrip plans and reads the output there, once too
    assert results["check"]["code"] == 0, results["check"]["stdout"] + results["check"]["stderr"]
    [checked] = [json.loads(line)["ranges"] for line in (root / "fetches.jsonl").read_text().splitlines()
                 if json.loads(line)["argv"][:1] == ["check"]]
    small = [tuple(r) for r in checked if r[2] - r[1] <= remote_input.SMALL_READ]
    assert small and len(small) == len(set(small)), "a small range fetched twice in one check"


def test_a_snapshot_keeps_its_listing_and_small_reads_and_nothing_else(converted, monkeypatch, tmp_path) -> None:
    """Within :func:`remote_input.one_snapshot`, a second reader of the same prefix asks the store for no small range
    the first fetched, and sees the listing the first saw (an object put meanwhile is not in it); large ranges are
    fetched each time they are asked for. Outside it, every opening asks again."""
    from osdpipe.io.formats.dcp_reader import DcpReader

    bucket, root, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    remote_input.configure({})
    url = bucket.url("src", "dcp")

    def meta_requests() -> int:
        remote_input.METER.reset()
        DcpReader(url, "optim").meta()
        return remote_input.METER.requests

    alone = meta_requests()
    assert alone > 1 and meta_requests() == alone  # outside a snapshot: asked again
    big = (root / "src" / "dcp" / "__0_0.distcp").stat().st_size
    monkeypatch.setattr(remote_input, "SMALL_READ", big - 1)  # this model's files are small; one is "large" here
    with remote_input.one_snapshot():
        assert meta_requests() == alone
        assert meta_requests() == 0
        listed = [p.name for p in remote_input.as_path(url).iterdir()]
        bucket.fs().pipe(f"{bucket.bucket}/src/dcp/late.txt", b"put after the listing")
        try:
            assert [p.name for p in remote_input.as_path(url).iterdir()] == listed
            whole = remote_input.as_path(url) / "__0_0.distcp"
            remote_input.METER.reset()
            local = (root / "src" / "dcp" / "__0_0.distcp").read_bytes()
            assert whole.read_range(0, big) == whole.read_range(0, big) == local
            assert remote_input.METER.requests == 2
        finally:
            bucket.fs().rm(f"{bucket.bucket}/src/dcp/late.txt")
    assert "late.txt" not in listed


def test_a_snapshot_taken_over_lists_nothing_and_fetches_no_small_range_again(converted, monkeypatch, tmp_path):
    """What a command has seen of its input (:func:`remote_input.seen`) is where the processes it starts go on from
    (:func:`remote_input.one_snapshot` given it): the listing the command made, an object put since not in it, and
    no small range it fetched asked for again."""
    from osdpipe.io.formats.dcp_reader import DcpReader

    bucket, _, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    remote_input.configure({})
    url = bucket.url("src", "dcp")
    assert remote_input.seen() is None  # outside a snapshot: nothing to hand over
    with remote_input.one_snapshot():
        remote_input.METER.reset()
        expected = DcpReader(url, "optim").meta()
        assert remote_input.METER.requests > 1
        listed = [p.name for p in remote_input.as_path(url).iterdir()]
        seen = remote_input.seen()
    bucket.fs().pipe(f"{bucket.bucket}/src/dcp/late.txt", b"put after the command listed the prefix")
    try:
        with remote_input.one_snapshot(seen):  # as a rank process takes it over
            remote_input.METER.reset()
            meta = DcpReader(url, "optim").meta()
            assert remote_input.METER.requests == 0
            assert [p.name for p in remote_input.as_path(url).iterdir()] == listed
        with remote_input.one_snapshot():  # a snapshot of its own lists and fetches again
            assert "late.txt" in [p.name for p in remote_input.as_path(url).iterdir()]
    finally:
        bucket.fs().rm(f"{bucket.bucket}/src/dcp/late.txt")
    assert meta.param_groups == expected.param_groups
    steps = [(f, e["step"]) for f, e in expected.state.items() if "step" in e]
    assert steps and all(torch.equal(meta.state[f]["step"], step) for f, step in steps)


def test_the_ranks_of_an_online_run_fetch_no_small_range_the_command_fetched(converted, monkeypatch, tmp_path):
    """An online conversion from ``s3://``: the command works out the config (reading the input's ``.metadata`` and
    small items), then starts its ranks; they go on from its snapshot, so no rank fetches a range the command did (a
    rank still reads the ranges its own plan needs). The output is byte for byte the local conversion's."""
    bucket, root, results = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    out = root / "from_s3_online"
    online = [*SOURCE[:-1], "runtime.mode=online", f"input.path={bucket.url('src', 'dcp')}", *TARGET,
              f"output.path={out}"]  # fmt: skip
    log = root / "fetches_online.jsonl"
    recorded = user_env(OSDPIPE_TEST_RECORD_FETCHES=str(log))
    [result] = run_cli_cases([online], cwd=root, per_case_s=TIMEOUT_S, env=recorded)
    assert result["code"] == 0, result["stdout"] + result["stderr"]
    assert _data(out) == _data(root / "from_local") and results["local"]["code"] == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(str(line["rank"]) for line in lines) == ["0", "1", "None"], lines  # the command and its 2 ranks
    assert all(line["ranges"] for line in lines), "a process that read nothing: is it recorded at all?"
    [command] = [set(map(tuple, line["ranges"])) for line in lines if line["rank"] is None]
    assert any(r[0].endswith("/.metadata") for r in command)
    ranks = {tuple(r) for line in lines if line["rank"] is not None for r in line["ranges"]}
    assert not command & ranks, f"fetched by the command, then again by a rank: {sorted(command & ranks)}"


def test_a_ranks_expected_reads_of_one_object_are_one_request(converted, monkeypatch, tmp_path) -> None:
    """The shard stage and the roundtrip check tell the reader every range a rank will read (``expect``): each
    object's items come in one request (here: the files are far below a request's bound), not one request per item,
    and the bytes are those of the local copy."""
    from osdpipe.io.formats.dcp_reader import DcpReader
    from osdpipe.layout.ranges import Segment
    from osdpipe.run.transfer import Batch, Source

    bucket, root, _ = converted
    aws_environment(monkeypatch, bucket.endpoint, tmp_path)
    remote_input.configure({})
    url = bucket.url("src", "dcp")
    remote, local = DcpReader(url, "optim"), DcpReader(str(root / "src" / "dcp"), "optim")
    meta = local.meta()
    # target rank 0 of 2: the first half of the rows of every moment, in source ranks 0 and 1's files
    reads = []
    for fqn, states in meta.state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            ref = states[name]
            row = int(torch.Size(ref.shape[1:]).numel())
            reads.append((fqn, name, 0, (ref.shape[0] + 1) // 2 * row))
    batches = [
        Batch(name, getattr(torch, meta.state[fqn][name].dtype), (Segment(fqn, start, stop - start, 0),))
        for fqn, name, start, stop in reads
    ]

    def read_all(expect: bool) -> list[torch.Tensor]:
        source = Source(remote, None)
        remote_input.METER.reset()
        if expect:
            source.expect(batches)
        try:
            return [torch.cat(source.parts(batch)[1]) for batch in batches]
        finally:
            source.expect([])

    one_by_one = read_all(expect=False)
    items = remote_input.METER.requests
    planned = read_all(expect=True)
    objects = sorted({u.rsplit("/", 1)[-1] for u, _, _ in remote_input.METER.ranges})
    assert objects == ["__0_0.distcp", "__1_0.distcp"]
    assert remote_input.METER.requests == len(objects) < items  # one request per object, not one per item
    want = [local.read_range(fqn, name, start, stop) for fqn, name, start, stop in reads]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(want, planned, one_by_one, strict=True))


def test_prefetch_keeps_several_requests_in_flight_within_its_bound() -> None:
    lock, state = threading.Lock(), {"now": 0, "most": 0, "bytes": 0, "most_bytes": 0}

    class Slow:
        def read_range(self, start: int, length: int) -> bytes:
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(0.02)
            with lock:
                state["now"] -= 1
            return bytes(length)

    path = Slow()
    wanted = [(path, i * 100, 100) for i in range(40)]
    prefetch = remote_input.Prefetch(wanted, limit=450)  # 4 ranges of 100 bytes fit
    try:
        for _, start, length in wanted:
            with prefetch._lock:
                state["most_bytes"] = max(state["most_bytes"], prefetch._held)
            assert prefetch.take(path, start, length) == bytes(length)
    finally:
        prefetch.close()
    assert state["most_bytes"] <= 450
    assert 2 <= state["most"] <= 4


def test_prefetch_fetches_ranges_that_follow_each_other_as_one_request() -> None:
    asked: list[tuple[int, int]] = []

    class Counting:
        def read_range(self, start: int, length: int) -> bytes:
            asked.append((start, length))
            return bytes((start + i) % 251 for i in range(length))

    path, other = Counting(), Counting()
    wanted = [(path, i * 100, 100) for i in range(20)] + [(path, 5000, 10), (other, 5010, 10), (path, 2000, 50)]
    prefetch = remote_input.Prefetch(wanted, limit=4000)  # requests of up to 1000 bytes
    try:
        for p, start, length in wanted:
            assert prefetch.take(p, start, length) == bytes((start + i) % 251 for i in range(length))
    finally:
        prefetch.close()
    # 20 ranges back to back: two requests of 1000 bytes (the bound); the range asked for last joins no request (it
    # would outgrow one), nor does a far one (the gap is over 1000 // 8) or one of another object
    assert sorted(asked) == [(0, 1000), (1000, 1000), (2000, 50), (5000, 10), (5010, 10)]


def test_prefetch_joins_ranges_of_one_object_across_a_small_gap_and_out_of_order() -> None:
    asked: list[tuple[int, int]] = []

    class Counting:
        def read_range(self, start: int, length: int) -> bytes:
            asked.append((start, length))
            return bytes((start + i) % 251 for i in range(length))

    a, b = Counting(), Counting()
    # two objects read in turn (as a rank reads two source ranks' files), each back to front, with small gaps
    wanted = [(p, start, 95) for start in (300, 200, 100, 0) for p in (a, b)]
    prefetch = remote_input.Prefetch(wanted, limit=40_000, gap=10)
    try:
        for p, start, length in wanted:
            assert prefetch.take(p, start, length) == bytes((start + i) % 251 for i in range(length))
    finally:
        prefetch.close()
    assert sorted(asked) == [(0, 395), (0, 395)]
