"""accelerate's ``save_state`` folders in object storage (SHARDED_STATE_DICT: two DCP directories; FULL_STATE_DICT:
``pytorch_model_fsdp.bin`` and ``optimizer.bin``, torch.save files), converted whole from ``s3://``: byte for byte as
their local copies convert, every carried file (``scheduler.bin``, ``random_states_<r>.pkl``, a user's own) copied
from the bucket (tests/cloud/conftest.py's S3 server; the folders as tests/support/whole_jobs.py saves them, as
accelerate does).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import whole_jobs
from cloudenv import S3, aws_environment
from helpers import run_cli_cases, user_env
from oracle_probe import spawn_world

TIMEOUT_S = 180
RECORDS = ("manifest.json", "report.json", "osdpipe.log")
SOURCE = ["checkpoint=accelerate", "model.factory=userlm:build", "source.kind=fsdp1", "source.world_size=4",
          "source.wrap=[MixerBlock]"]  # fmt: skip
#: Each folder and the target it is converted to.
FOLDERS = {
    "sharded": ["target.kind=fsdp2", "target.world_size=2", "output.format=rank_local"],
    "full": ["target.kind=fsdp1", "target.world_size=2", "target.wrap=[MixerBlock]", "target.use_orig_params=true",
             "output.format=fsdp_full"],
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(s3_endpoint: str, tmp_path_factory) -> tuple[S3, Path, dict[str, dict]]:
    root = tmp_path_factory.mktemp("s3_accelerate")
    spawn_world(whole_jobs.save_accelerate, 4, (str(root / "sharded"),), timeout_s=TIMEOUT_S)
    spawn_world(whole_jobs.save_accelerate_full, 4, (str(root / "full"),), timeout_s=TIMEOUT_S)
    with pytest.MonkeyPatch.context() as monkeypatch:
        aws_environment(monkeypatch, s3_endpoint, root)
        bucket = S3(s3_endpoint, f"osdpipe-{uuid.uuid4().hex[:16]}")
        bucket.fs().mkdir(bucket.bucket)
        cases: dict[str, list[str]] = {}
        for name, target in FOLDERS.items():
            bucket.fs().put(f"{root / name / 'checkpoint_0'}/", f"{bucket.bucket}/{name}/checkpoint_0/", recursive=True)
            cases[f"{name}-local"] = [*SOURCE, f"input.path={root / name / 'checkpoint_0'}", *target,
                                      f"output.path={root / (name + '-local')}"]  # fmt: skip
            cases[f"{name}-s3"] = [*SOURCE, f"input.path={bucket.url(name, 'checkpoint_0')}", *target,
                                   f"output.path={root / (name + '-s3')}"]  # fmt: skip
        cases["sharded-s3-to-s3"] = [*SOURCE, f"input.path={bucket.url('sharded', 'checkpoint_0')}",
                                     *FOLDERS["sharded"], f"output.path={bucket.url('out')}"]  # fmt: skip
        cases["inspect"] = ["inspect", bucket.url("full", "checkpoint_0")]
        results = run_cli_cases(list(cases.values()), cwd=root, per_case_s=TIMEOUT_S, env=user_env())
        if results[-2]["code"] == 0:
            bucket.fs().get(f"{bucket.bucket}/out/", str(root / "sharded-s3-to-s3") + "/", recursive=True)
    return bucket, root, dict(zip(cases, results, strict=True))


def _data(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*")
            if p.is_file() and p.name not in RECORDS}  # fmt: skip


@pytest.mark.parametrize("case", ["sharded-s3", "full-s3", "sharded-s3-to-s3"])
def test_an_accelerate_folder_in_s3_converts_whole_byte_for_byte_as_its_local_copy(runs, case: str) -> None:
    bucket, root, results = runs
    local = case.split("-")[0] + "-local"
    for name in (local, case):
        assert results[name]["code"] == 0, results[name]["stderr"]
    mine, theirs = _data(root / case), _data(root / local)
    assert theirs and mine == theirs
    assert any(n.endswith("scheduler.bin") for n in mine) and any("random_states_" in n for n in mine)
    manifests = [json.loads((root / d / "manifest.json").read_text()) for d in (local, case)]
    assert manifests[1]["content_sha256"] == manifests[0]["content_sha256"]
    report = json.loads((root / case / "report.json").read_text())
    assert report["ok"] and all(c["ok"] for c in report["checks"]), report["checks"]


def test_inspect_names_an_accelerate_folder_in_s3(runs) -> None:
    _, _, results = runs
    assert results["inspect"]["code"] == 0, results["inspect"]["stderr"]
    assert "accelerate" in results["inspect"]["stdout"]
