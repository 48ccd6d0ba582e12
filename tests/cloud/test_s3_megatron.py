"""``output.path=s3://...`` for conversions by Megatron's own stages: a Megatron-LM save to another grid, into a real
S3 server (tests/cloud/conftest.py), byte for byte what the same conversion writes on the local disk, committed whole:
``latest_checkpointed_iteration.txt``, which Megatron-LM's load reads first, after the iteration's ``.metadata``."""

from __future__ import annotations

import json
from pathlib import Path

from cloudenv import S3
from helpers import run_cli_cases, run_osdpipe, user_env
from hf_llama_folder import write_llama
from megatron_oracle import read_save
from megatron_oracle_check import roundtrip_problems
from synthetic_megatron import synthetic_save

from osdpipe.io import remote_output

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


def test_a_megatron_save_in_the_bucket_converts_as_its_local_copy(s3: S3, tmp_path: Path) -> None:
    """``input.path=s3://...`` of a Megatron-LM save (``latest_checkpointed_iteration.txt`` followed, ``common.pt`` and
    the iteration's DCP items read by range): to another Megatron grid, to a Hugging Face folder (both by Megatron's
    own stages) and to a torchtitan step folder (the range pipeline), each byte for byte what the same conversion of
    the local copy writes; ``osdpipe inspect`` of the URL names the save; ``osdpipe check`` proves the output against
    the save in the bucket."""
    source = synthetic_save(tmp_path, tp=2)
    s3.fs().put(f"{source}/", f"{s3.bucket}/save/", recursive=True)
    conversions = {
        "megatron": ["target.tp_size=1", "target.pp_size=2", "target.world_size=2"],
        "hf": ["output.checkpoint=hf"],
        "torchtitan": ["output.checkpoint=torchtitan", "target.kind=fsdp2", "target.world_size=2",
                       "runtime.mode=offline"],
    }  # fmt: skip
    # runtime.debug: a failed case prints its traceback (the local torchtitan case has failed now and then: the resume
    # check, a few ulp off on tok_embeddings.weight, not yet explained)
    cases = [["checkpoint=megatron", f"input.path={where}", *args, f"output.path={tmp_path / name / side}",
              "runtime.debug=true"]
             for name, args in conversions.items() for side, where in (("local", source), ("s3", s3.url("save")))]
    cases.append(["inspect", s3.url("save")])
    results = run_cli_cases(cases, cwd=tmp_path, per_case_s=240, env=user_env())
    assert [r["code"] for r in results] == [0] * len(cases), _failed(cases, results)
    for name in conversions:
        manifest = _same_conversion(tmp_path / name / "local", tmp_path / name / "s3")
        assert manifest["config"]["input"]["path"] in (s3.url("save"), s3.url("save", "iter_0000007")), name
    shown = results[-1]["stdout"]
    assert "layout       megatron" in shown and s3.url("save", "iter_0000007") in shown, shown
    [checked] = run_cli_cases([["check", str(tmp_path / "megatron" / "s3")]], cwd=tmp_path, env=user_env())
    assert checked["code"] == 0 and "check roundtrip  pass" in checked["stdout"], checked["stdout"] + checked["stderr"]
    assert s3.url("save") in checked["stdout"]  # proven against the save in the bucket, read again


def test_a_hugging_face_folder_in_the_bucket_converts_to_megatron_as_its_local_copy(s3: S3, tmp_path: Path) -> None:
    """``checkpoint=hf`` from ``s3://``: ``config.json``, the index and each safetensors shard (its header by range for
    ``inspect``) read from the bucket; the Megatron-LM save is byte for byte the local copy's conversion, and
    ``osdpipe check`` proves it against the folder in the bucket."""
    write_llama(tmp_path / "hf")
    s3.fs().put(f"{tmp_path / 'hf'}/", f"{s3.bucket}/hf/", recursive=True)
    grid = ["checkpoint=hf", "target.tp_size=2", "target.pp_size=2", "target.world_size=4"]
    cases = [[*grid, f"input.path={where}", f"output.path={tmp_path / side}"]
             for side, where in (("local", tmp_path / "hf"), ("s3", s3.url("hf")))]
    cases += [["inspect", s3.url("hf")], ["check", str(tmp_path / "s3")]]
    results = run_cli_cases(cases, cwd=tmp_path, per_case_s=240, env=user_env())
    assert [r["code"] for r in results] == [0] * len(cases), _failed(cases, results)
    _same_conversion(tmp_path / "local", tmp_path / "s3")
    assert "layout       hf" in results[2]["stdout"], results[2]["stdout"]
    assert "check roundtrip  pass" in results[3]["stdout"] and s3.url("hf") in results[3]["stdout"], results[3]


def test_a_torchtitan_step_in_the_bucket_converts_to_megatron_as_its_local_copy(s3: S3, tmp_path: Path) -> None:
    """A PyTorch job's whole checkpoint from ``s3://`` into a Megatron-LM save: a torchtitan step folder (osdpipe's
    conversion of a Megatron save, ``model_args.json`` beside it naming its llama3), read from the bucket as the
    range pipeline reads it, mapped to Megatron's layout; byte for byte the local copy's conversion, the same
    ``content_sha256``."""
    source = synthetic_save(tmp_path, tp=2)
    made = run_cli_cases([["checkpoint=megatron", f"input.path={source}", "output.checkpoint=torchtitan",
                           "target.kind=fsdp2", "target.world_size=2", "runtime.mode=offline",
                           f"output.path={tmp_path / 'titan'}"]], cwd=tmp_path, per_case_s=240, env=user_env())
    assert made[0]["code"] == 0, made[0]["stderr"][-1500:]
    s3.fs().put(f"{tmp_path / 'titan'}/", f"{s3.bucket}/titan/", recursive=True)
    grid = ["checkpoint=torchtitan", "output.checkpoint=megatron", "target.tp_size=2", "target.pp_size=1",
            "target.world_size=2"]
    cases = [[*grid, f"input.path={where}", f"output.path={tmp_path / side}"]
             for side, where in (("local", tmp_path / "titan"), ("s3", s3.url("titan")))]
    results = run_cli_cases(cases, cwd=tmp_path, per_case_s=240, env=user_env())
    assert [r["code"] for r in results] == [0, 0], _failed(cases, results)
    manifest = _same_conversion(tmp_path / "local", tmp_path / "s3")
    # the step the output folder holds (the save's iteration 7), as the local conversion records its own
    assert manifest["input_path_absolute"] == s3.url("titan/step-7")


def _failed(cases: list[list[str]], results: list[dict]) -> str:
    """Each failed case: its command line, exit code and whole stderr."""
    return "\n".join(f"osdpipe {' '.join(args)} -> {r['code']}\n{r['stderr']}"
                     for args, r in zip(cases, results) if r["code"] != 0)


def _same_conversion(local: Path, remote: Path) -> dict:
    """Two conversions of one source, its local copy's and the bucket's: the same files byte for byte (what a run
    writes about itself aside) and the same ``content_sha256``. Returns the bucket's conversion's manifest."""
    local_files, remote_files = (
        {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name not in RECORDS}
        for d in (local, remote)
    )
    assert local_files and remote_files == local_files, remote
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (local, remote)]
    assert manifests[0]["content_sha256"] == manifests[1]["content_sha256"], remote
    return manifests[1]
