"""``torch.save`` optimizer files in object storage (``fsdp_full``, ``plain``, ``rank_local``): converted by ranged
reads of their records, byte for byte as their local copies are (tests/cloud/conftest.py's S3 server).

A remote file is loaded without its tensor bytes (:mod:`osdpipe.io.remote_torchfile`); each tensor's pages are
fetched as a reader reads them, and memory not fetched is unreadable (:mod:`osdpipe.io.fetched_memory`): a path that
read a tensor without fetching it would crash these runs (SIGSEGV), never convert zeros.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cloudenv import S3, bucket_with_a_users_job
from helpers import run_cli_cases, user_env

from osdpipe.io import fetched_memory, remote_input
from osdpipe.io.formats.safe_load import load_torch_file

TIMEOUT_S = 180
RECORDS = ("manifest.json", "report.json", "osdpipe.log")
MODEL = ["model.factory=userlm:build"]
#: Each source: its file or folder (under the root and under ``src/`` in the bucket) and the overrides that read it.
SOURCES = {
    "fsdp_full": ("optim.pt", ["source.world_size=1", "runtime.mode=offline", "target.kind=fsdp2",
                               "target.world_size=2"]),
    "fsdp_full_online": ("optim.pt", ["source.world_size=1", "target.kind=fsdp2", "target.world_size=2"]),
    "plain": ("plain.pt", ["input.format=plain", "input.param_groups=[[*]]", "source.kind=none",
                           "source.world_size=1", "runtime.mode=offline", "target.kind=fsdp2", "target.world_size=3"]),
    "rank_local": ("ranks", ["input.format=rank_local", "source.kind=fsdp2", "source.world_size=2",
                             "runtime.mode=offline", "target.kind=fsdp1", "target.world_size=3",
                             "target.wrap=[MixerBlock]"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def converted(s3_endpoint: str, tmp_path_factory) -> tuple[S3, Path, dict[str, dict]]:
    """The user's job saved as an ``fsdp_full`` file, a ``plain`` file and a folder of ``rank_local`` files, each
    copied under ``s3://<bucket>/src/``; each converted from its local copy and from the bucket."""
    import userlm

    root = tmp_path_factory.mktemp("s3_torchsave")
    with pytest.MonkeyPatch.context() as monkeypatch:
        bucket = bucket_with_a_users_job(monkeypatch, s3_endpoint, root)
        torch.manual_seed(0)
        model = userlm.build()
        torch.save(userlm.train(model, steps=2).state_dict(), root / "plain.pt")
        ranks = [*MODEL, f"input.path={root / 'optim.pt'}", "source.world_size=1", "runtime.mode=offline",
                 "target.kind=fsdp2", "target.world_size=2", f"output.path={root / 'ranks'}"]  # fmt: skip
        [made] = run_cli_cases([ranks], cwd=root, per_case_s=TIMEOUT_S, env=user_env())
        assert made["code"] == 0, made["stderr"]
        fs = bucket.fs()
        fs.put(str(root / "optim.pt"), f"{bucket.bucket}/src/optim.pt")
        fs.put(str(root / "plain.pt"), f"{bucket.bucket}/src/plain.pt")
        for rank_file in sorted((root / "ranks").glob("rank_*.pt")):
            fs.put(str(rank_file), f"{bucket.bucket}/src/ranks/{rank_file.name}")
        cases: dict[str, list[str]] = {}
        for name, (where, overrides) in SOURCES.items():
            cases[f"{name}-local"] = [*MODEL, f"input.path={root / where}", *overrides, f"output.path={root / name}"]
            cases[f"{name}-s3"] = [*MODEL, f"input.path={bucket.url('src', where)}", *overrides,
                                   f"output.path={root / (name + '-s3')}"]  # fmt: skip
        cases["inspect"] = ["inspect", bucket.url("src", "optim.pt")]
        cases["inspect_ranks"] = ["inspect", bucket.url("src", "ranks")]
        results = run_cli_cases(list(cases.values()), cwd=root, per_case_s=TIMEOUT_S, env=user_env())
    return bucket, root, dict(zip(cases, results, strict=True))


def _data(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*")
            if p.is_file() and p.name not in RECORDS}  # fmt: skip


@pytest.mark.parametrize("source", SOURCES)
def test_a_torch_save_input_in_s3_converts_byte_for_byte_as_its_local_copy(converted, source: str) -> None:
    bucket, root, results = converted
    for side in ("local", "s3"):
        assert results[f"{source}-{side}"]["code"] == 0, results[f"{source}-{side}"]["stderr"]
    local, remote = root / source, root / f"{source}-s3"
    assert _data(local) and _data(remote) == _data(local)
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (local, remote)]
    assert manifests[1]["content_sha256"] == manifests[0]["content_sha256"]
    report = json.loads((remote / "report.json").read_text())
    assert report["ok"] is True and all(c["ok"] for c in report["checks"])
    if source == "fsdp_full_online":  # PyTorch's own path and the target optimizer ran over the remote source
        assert {"roundtrip", "reference", "load_step", "resume"} <= {c["name"] for c in report["checks"]}


def test_inspect_reads_a_torch_save_file_and_a_folder_of_rank_files_in_s3(converted) -> None:
    bucket, _, results = converted
    for case, format_name in (("inspect", "fsdp_full"), ("inspect_ranks", "rank_local")):
        assert results[case]["code"] == 0, results[case]["stderr"]
        assert format_name in results[case]["stdout"], results[case]["stdout"]


def test_a_range_is_fetched_alone_the_file_never_whole_and_again_once_let_go(s3: S3, tmp_path: Path) -> None:
    """A file of two 4 MB moments: loading it fetches its structure, reading three elements fetches their page."""
    local_path = tmp_path / "big.pt"
    torch.manual_seed(0)
    torch.save({"state": {"w": {"exp_avg": torch.randn(1024, 1024), "exp_avg_sq": torch.rand(1024, 1024),
                                "step": torch.tensor(7.0)}},
                "param_groups": [{"lr": 0.1, "params": ["w"]}]}, local_path)  # fmt: skip
    s3.fs().put(str(local_path), f"{s3.bucket}/big.pt")
    remote_input.configure({})
    local = load_torch_file(local_path)["state"]["w"]
    remote_input.METER.reset()
    remote = load_torch_file(s3.url("big.pt"))["state"]["w"]
    size = local_path.stat().st_size
    assert sum(end - start for _, start, end in remote_input.METER.ranges) < size // 8
    assert remote["step"].item() == 7.0  # a scalar: fetched with the structure
    theirs, ours = remote["exp_avg"], local["exp_avg"]
    remote_input.METER.reset()
    fetched_memory.fetch(theirs, 1000, 1003)
    [(_, start, end)] = remote_input.METER.ranges  # one request: the page under those three elements
    assert end - start == fetched_memory.PAGE
    assert torch.equal(theirs.reshape(-1)[1000:1003], ours.reshape(-1)[1000:1003])
    fetched_memory.fetch_all(remote)
    assert torch.equal(theirs, ours) and torch.equal(remote["exp_avg_sq"], local["exp_avg_sq"])
    remote_input.METER.reset()
    assert fetched_memory.let_go(theirs, 0, theirs.numel())
    fetched_memory.fetch(theirs, 0, 10)
    assert remote_input.METER.ranges, "let go, the pages were fetched again"
    fetched_memory.fetch(theirs)
    assert torch.equal(theirs, ours)


def test_reading_a_tensor_that_was_never_fetched_crashes_rather_than_reading_zeros(s3: S3, tmp_path: Path) -> None:
    torch.save({"state": {"w": {"exp_avg": torch.ones(1024, 64)}}}, tmp_path / "one.pt")
    s3.fs().put(str(tmp_path / "one.pt"), f"{s3.bucket}/one.pt")
    job = tmp_path / "touch.py"
    job.write_text(textwrap.dedent(f"""
        from osdpipe.io.formats.safe_load import load_torch_file
        tensor = load_torch_file({s3.url("one.pt")!r})["state"]["w"]["exp_avg"]
        print("loaded", tuple(tensor.shape), flush=True)
        print(float(tensor.sum()))  # never fetched
    """))
    done = subprocess.run(
        [sys.executable, str(job)], capture_output=True, text=True, timeout=120, env=user_env(), check=False
    )
    assert done.stdout.startswith("loaded (1024, 64)"), done.stderr
    assert done.returncode == -11, (done.returncode, done.stdout, done.stderr)


def test_reads_told_ahead_are_fetched_as_one_request_and_read_without_another(s3: S3, tmp_path: Path) -> None:
    """The shard stage tells a reader its reads first (``expect``): an ``fsdp_full`` file's eight moments, records
    side by side in the file, come in one ranged request, and reading them asks for nothing more."""
    from osdpipe.io.formats.fsdp_full import FullReader

    torch.manual_seed(0)
    state = {f"layer{i}.weight": {"exp_avg": torch.randn(256, 256), "step": torch.tensor(3.0)} for i in range(8)}
    torch.save({"state": state, "param_groups": [{"lr": 0.1, "params": list(state)}]}, tmp_path / "optim.pt")
    s3.fs().put(str(tmp_path / "optim.pt"), f"{s3.bucket}/optim.pt")
    remote_input.configure({})
    reader = FullReader(s3.url("optim.pt"))
    reads = [(fqn, "exp_avg", 1000, 60000) for fqn in state]
    reader.meta()
    remote_input.METER.reset()
    reader.expect(reads)
    got = {fqn: reader.read_range(fqn, name, start, stop).clone() for fqn, name, start, stop in reads}
    reader.expect([])
    [(_, start, end)] = remote_input.METER.ranges
    assert end - start < (tmp_path / "optim.pt").stat().st_size
    for fqn, value in got.items():
        assert torch.equal(value, state[fqn]["exp_avg"].reshape(-1)[1000:60000])
