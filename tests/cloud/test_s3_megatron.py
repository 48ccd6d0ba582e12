"""``output.path=s3://...`` for conversions by Megatron's own stages: a Megatron-LM save to another grid, into a real
S3 server (tests/cloud/conftest.py), byte for byte what the same conversion writes on the local disk, committed whole:
``latest_checkpointed_iteration.txt``, which Megatron-LM's load reads first, after the iteration's ``.metadata``."""

from __future__ import annotations

import json
from pathlib import Path

from cloudenv import S3
from helpers import run_osdpipe
from synthetic_megatron import synthetic_save

from osdpipe.io import remote_output
from osdpipe.io.formats.megatron import read_save
from osdpipe.verify.megatron import roundtrip_problems

RECORDS = ("manifest.json", "report.json", "osdpipe.log")


def test_a_megatron_conversion_into_the_bucket_is_the_local_one_byte_for_byte(s3: S3, tmp_path: Path) -> None:
    bucket = s3
    source = synthetic_save(tmp_path, tp=2)
    grid = ["checkpoint=megatron", f"input.path={source}", "target.tp_size=1", "target.pp_size=2",
            "target.world_size=2"]
    for where in (str(tmp_path / "local"), bucket.url("megatron")):
        done = run_osdpipe(*grid, f"output.path={where}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
    local = {p.relative_to(tmp_path / "local").as_posix(): p.read_bytes()
             for p in (tmp_path / "local").rglob("*") if p.is_file()}
    fs = bucket.fs()
    remote = {key[len("megatron/"):]: fs.cat_file(f"{bucket.bucket}/{key}") for key in bucket.keys("megatron")}
    assert set(remote) == set(local)
    assert {k: v for k, v in remote.items() if Path(k).name not in RECORDS} == \
        {k: v for k, v in local.items() if Path(k).name not in RECORDS}
    manifest = json.loads(remote["manifest.json"])
    assert manifest["content_sha256"] == json.loads(local["manifest.json"])["content_sha256"]
    assert manifest["config"]["output"]["path"] == bucket.url("megatron")
    fs.get(f"{bucket.bucket}/megatron", str(tmp_path / "down"), recursive=True)
    assert roundtrip_problems(read_save(source), read_save(tmp_path / "down")) == []


def test_megatron_lm_s_latest_file_is_committed_after_the_iterations_metadata_and_before_the_manifest() -> None:
    names = ["manifest.json", "latest_checkpointed_iteration.txt", "iter_0000007/.metadata", "iter_0000007/common.pt",
             "iter_0000007/__0_0.distcp"]
    assert remote_output.markers_last(names) == [
        "iter_0000007/__0_0.distcp", "iter_0000007/common.pt", "iter_0000007/.metadata",
        "latest_checkpointed_iteration.txt", "manifest.json"]
