"""Whole checkpoints from object storage (issue 41): a torchtitan step folder (and torchtitan's folder of step
folders) and PyTorch's own layout (a DCP directory of ``model`` and ``optim``) convert from ``s3://`` as they do from
the local disk, byte for byte; ``osdpipe inspect`` names the layout from the URL and ``osdpipe check`` proves a
conversion against the URL it was read from (accelerate's: tests/cloud/test_s3_accelerate.py; DeepSpeed's:
tests/frameworks/test_deepspeed.py; Megatron-LM's, a Hugging Face folder's and a torchtitan step into a Megatron-LM
save: tests/cloud/test_s3_megatron.py).

The sources are a 4-rank gloo job of the tests' own model saved as torchtitan saves (tests/support/whole_jobs.py), and
osdpipe's own conversion of it to PyTorch's layout; they are uploaded with s3fs to the test's S3 server
(tests/cloud/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import whole_jobs
from cloudenv import S3, aws_environment
from helpers import run_cli_cases, user_env
from oracle_probe import spawn_world

TIMEOUT_S = 180
MODEL = ["model.factory=userlm:build"]
TARGET = ["target.kind=fsdp2", "target.world_size=2"]
#: What a conversion writes about itself (paths in it differ with where it read and wrote).
RECORDS = ("manifest.json", "report.json", "osdpipe.log")


def _data(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name not in RECORDS}


@pytest.fixture(scope="module")
def runs(s3_endpoint: str, tmp_path_factory) -> tuple[S3, Path, dict[str, dict]]:
    """The torchtitan folder and a PyTorch-layout checkpoint, local and in a bucket; each converted from both, and the
    commands on URLs run."""
    import uuid

    root = tmp_path_factory.mktemp("s3_whole")
    spawn_world(whole_jobs.save_torchtitan, 4, (str(root / "titan"),), timeout_s=TIMEOUT_S)
    with pytest.MonkeyPatch.context() as monkeypatch:
        aws_environment(monkeypatch, s3_endpoint, root)
        bucket = S3(s3_endpoint, f"osdpipe-{uuid.uuid4().hex[:16]}")
        fs = bucket.fs()
        fs.mkdir(bucket.bucket)
        made = run_cli_cases([["checkpoint=torchtitan", *MODEL, f"input.path={root / 'titan' / 'step-2'}",
                               "output.checkpoint=pytorch", *TARGET, f"output.path={root / 'pytorch'}"]],
                             cwd=root, per_case_s=TIMEOUT_S, env=user_env())
        assert made[0]["code"] == 0, made[0]["stderr"]
        fs.put(f"{root / 'titan' / 'step-2'}/", f"{bucket.bucket}/titan/step-2/", recursive=True)
        fs.put(f"{root / 'pytorch' / 'dcp'}/", f"{bucket.bucket}/pytorch/dcp/", recursive=True)
        titan = ["checkpoint=torchtitan", *MODEL, *TARGET]
        pytorch = ["checkpoint=pytorch", *MODEL, *TARGET]
        cases = {
            "titan_local": [*titan, f"input.path={root / 'titan' / 'step-2'}", f"output.path={root / 'titan_local'}"],
            "titan_s3": [*titan, f"input.path={bucket.url('titan', 'step-2')}", f"output.path={root / 'titan_s3'}"],
            "titan_folder_s3": [*titan, f"input.path={bucket.url('titan')}", f"output.path={root / 'folder_s3'}"],
            "titan_s3_to_s3": [*titan, f"input.path={bucket.url('titan')}", f"output.path={bucket.url('out')}"],
            "pytorch_local": [*pytorch, f"input.path={root / 'pytorch' / 'dcp'}",
                              f"output.path={root / 'pytorch_local'}"],
            "pytorch_s3": [*pytorch, f"input.path={bucket.url('pytorch', 'dcp')}",
                           f"output.path={root / 'pytorch_s3'}"],
            "inspect": ["inspect", bucket.url("titan"), "--json"],
            "check": ["check", str(root / "titan_s3")],
            "check_s3": ["check", bucket.url("out")],
        }
        results = run_cli_cases(list(cases.values()), cwd=root, per_case_s=TIMEOUT_S, env=user_env())
    return bucket, root, dict(zip(cases, results, strict=True))


def test_a_torchtitan_step_in_s3_converts_byte_for_byte_as_its_local_copy(runs) -> None:
    bucket, root, done = runs
    for name in ("titan_local", "titan_s3", "titan_folder_s3", "titan_s3_to_s3"):
        assert done[name]["code"] == 0, (name, done[name]["stderr"])
    local = _data(root / "titan_local")
    assert "step-2/.metadata" in local
    assert _data(root / "titan_s3") == local and _data(root / "folder_s3") == local
    fs = bucket.fs()
    assert {k.removeprefix("out/"): fs.cat(f"{bucket.bucket}/{k}") for k in bucket.keys("out")
            if k.rsplit("/", 1)[-1] not in RECORDS} == local
    manifests = [json.loads((root / d / "manifest.json").read_text()) for d in ("titan_local", "titan_s3")]
    assert manifests[0]["content_sha256"] == manifests[1]["content_sha256"]
    assert manifests[1]["input_path_absolute"] == bucket.url("titan", "step-2")  # a URL is where it is from anywhere
    assert "converting the newest, " + bucket.url("titan", "step-2") in done["titan_folder_s3"]["stderr"]


def test_pytorchs_layout_in_s3_converts_byte_for_byte_as_its_local_copy(runs) -> None:
    _, root, done = runs
    assert done["pytorch_local"]["code"] == 0 and done["pytorch_s3"]["code"] == 0, done["pytorch_s3"]["stderr"]
    assert _data(root / "pytorch_s3") == _data(root / "pytorch_local") != {}


def test_inspect_names_the_whole_checkpoint_from_its_url(runs) -> None:
    bucket, _, done = runs
    assert done["inspect"]["code"] == 0, done["inspect"]["stderr"]
    shown = json.loads(done["inspect"]["stdout"])["checkpoint"]
    assert shown["layout"] == "torchtitan" and shown["path"] == bucket.url("titan", "step-2")
    assert {e["name"] for e in shown["entries"] if e["part"] == "optimizer"} == {"optimizer"}
    assert f"input.path={bucket.url('titan', 'step-2')}" in shown["command"]


def test_check_proves_a_conversion_against_the_url_it_read(runs) -> None:
    bucket, _, done = runs
    assert done["check"]["code"] == 0, done["check"]["stdout"] + done["check"]["stderr"]
    shown = done["check"]["stdout"]
    assert "check roundtrip  pass" in shown and bucket.url("titan", "step-2") in shown


def test_check_of_a_whole_conversion_in_s3_proves_it_against_its_source(runs) -> None:
    """``osdpipe check s3://...`` of the torchtitan step folder committed into the bucket: its files hashed as they
    stream in, and ``roundtrip``: the step folder's DCP items, read from the bucket, held against the source's."""
    bucket, _, done = runs
    result = done["check_s3"]
    assert result["code"] == 0, result["stdout"] + result["stderr"]
    assert "check roundtrip  pass" in result["stdout"] and bucket.url("titan", "step-2") in result["stdout"], result
