"""Real accelerate saves, the ``osdpipe`` command converts, real accelerate's ``load_state`` resumes (issue 30).

accelerate 1.15's ``Accelerator.save_state`` writes the source on 4 CPU ranks
(FSDP forced on CPU as accelerate sets it on a GPU: :mod:`frameworks.accel_job`),
with the tests' own model (tied embeddings or not, odd sizes), AdamW in two
param groups and a scheduler. osdpipe converts the folder to 2 ranks, and a
fresh 2-rank job, as a user resumes, calls ``load_state`` with an optimizer
that has not stepped: the model, the optimizer state and param groups and the
scheduler it holds, gathered whole, equal the saving job's bit for bit, and
one more step gives a finite loss.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from frameworks import accel
from helpers import run_command, user_env

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

STEPS = 3


def _convert(work: Path, source: Path, name: str, tied: bool, *overrides: str) -> tuple[Path, str]:
    out = work / name
    done = run_command(
        [sys.executable, "-m", "osdpipe", "checkpoint=accelerate", "model.factory=frameworks.accel_job:AccelLM",
         f"+model.kwargs.tied={str(tied).lower()}", f"input.path={source}", "target.world_size=2", *overrides,
         f"output.path={out}"],
        cwd=work, timeout=400, env=user_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "dcp", done.stderr


def _resumed(work: Path, folder: Path, fsdp_version: int, state_dict_type: str, tied: bool) -> dict:
    loaded = accel.load(
        work, 2, folder, fsdp_version=fsdp_version, state_dict_type=state_dict_type, tied=tied, steps=STEPS
    )
    assert math.isfinite(loaded["loss_after"])
    return loaded


def test_fsdp2_sharded_with_tied_embeddings_4_to_2_loads_into_a_fresh_optimizer(tmp_path) -> None:
    source = accel.save(
        tmp_path, 4, STEPS, out=tmp_path / "fsdp2", fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", tied=True
    )
    folder, said = _convert(tmp_path, source, "out", True, "target.kind=fsdp2")
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    # what load_state does with the old world's files
    assert "holds the RNG states of 4 processes, the target has 2" in said
    got = _resumed(tmp_path, folder, 2, "SHARDED_STATE_DICT", True)
    assert accel.compare(torch.load(accel.dump_path(source), weights_only=False), got) == []


def test_fsdp1_full_state_dict_converts_to_full_files_that_a_full_state_dict_job_loads(tmp_path) -> None:
    source = accel.save(
        tmp_path, 4, STEPS, out=tmp_path / "fsdp1-full", fsdp_version=1, state_dict_type="FULL_STATE_DICT", tied=False
    )
    folder, _ = _convert(tmp_path, source, "out", False, "target.kind=fsdp1", "target.use_orig_params=true")
    # FULL in, FULL out
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "scheduler.bin"} <= {p.name for p in folder.iterdir()}
    got = _resumed(tmp_path, folder, 1, "FULL_STATE_DICT", False)
    assert accel.compare(torch.load(accel.dump_path(source), weights_only=False), got) == []


def test_fsdp1_sharded_is_told_of_load_states_trap_and_its_full_output_loads(tmp_path) -> None:
    """accelerate's own FSDP1 SHARDED load into a fresh optimizer drops the moments (the source's own folder does the
    same); the run says so, and the FULL output it offers loads whole."""
    source = accel.save(
        tmp_path,
        4,
        STEPS,
        out=tmp_path / "fsdp1-sharded",
        fsdp_version=1,
        state_dict_type="SHARDED_STATE_DICT",
        tied=True,
    )
    want = torch.load(accel.dump_path(source), weights_only=False)
    sharded, said = _convert(tmp_path, source, "sharded", True, "target.kind=fsdp1", "target.use_orig_params=true")
    assert "loads no optimizer state" in said and "output.format=fsdp_full" in said
    report = json.loads((sharded.parent / "report.json").read_text())
    assert any("loads no optimizer state" in w for w in report["warnings"])
    dropped = _resumed(tmp_path, sharded, 1, "SHARDED_STATE_DICT", True)
    # accelerate's own path, as documented
    assert all(r["optim_state_len"] == 0 for r in dropped["info"]["after_load_per_rank"])
    full, _ = _convert(
        tmp_path, source, "full", True, "target.kind=fsdp1", "target.use_orig_params=true", "output.format=fsdp_full"
    )
    assert accel.compare(want, _resumed(tmp_path, full, 1, "FULL_STATE_DICT", True)) == []


#: The Trainer's FSDP versions: its default state-dict type for FSDP2 (FULL), and FSDP1 set to FULL
#: (SHARDED falls in load_state's trap above).
TRAINER_SETUPS = {
    "fsdp2": ({"version": 2, "state_dict_type": None}, ["target.kind=fsdp2"]),
    "fsdp1-full": (
        {"version": 1, "state_dict_type": "FULL_STATE_DICT"}, ["target.kind=fsdp1", "target.use_orig_params=true"]
    ),
}


@pytest.mark.parametrize("setup", list(TRAINER_SETUPS))
def test_the_trainers_final_checkpoint_resumes_at_its_step_on_another_world(tmp_path, setup, monkeypatch) -> None:
    """The HF Trainer saves checkpoint-3 at the end of its linear schedule (lr 0.0, a fact osdpipe takes as it is) on 2
    ranks; converted to 4, ``resume_from_checkpoint`` resumes there at step 3 with the optimizer's state loaded, and
    trains on. What the resumed job holds right after its load, gathered, is what the saving job held. The same
    checkpoint copied into a bucket (an S3 server on 127.0.0.1) converts from ``s3://`` into the same bytes, with no
    ``model.factory``: the Trainer's ``config.json`` of the Llama builds it (read from the bucket), as ``osdpipe
    inspect``'s command says."""
    from cloud.cloudenv import s3_bucket

    fsdp, target = TRAINER_SETUPS[setup]
    spec = {**fsdp, "resume": None, "tied": True}
    accel.trainer(
        tmp_path,
        2,
        {**spec, "out": str(tmp_path / "run"), "max_steps": 3, "dump": str(tmp_path / "saved.pt")},
        label="train",
    )
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert [g["lr"] for g in torch.load(checkpoint / "optimizer.bin", weights_only=True)["param_groups"]] == [0.0, 0.0]
    done = run_command(
        [sys.executable, "-m", "osdpipe", "checkpoint=accelerate",
         "model.factory=frameworks.accel_trainer_job:build_llama", "+model.kwargs.tied=true",
         f"input.path={checkpoint}", *target, "target.world_size=4", f"output.path={tmp_path / 'out'}"],
        cwd=tmp_path, timeout=400, env=user_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "out" / "dcp"
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= {
        p.name for p in folder.iterdir()
    }
    with monkeypatch.context() as env, s3_bucket(env, tmp_path) as bucket:
        bucket.fs().put(f"{tmp_path / 'run'}/", f"{bucket.bucket}/run/", recursive=True)
        from_s3 = run_command(
            [sys.executable, "-m", "osdpipe", "checkpoint=accelerate",
             f"input.path={bucket.url('run', 'checkpoint-3')}", *target, "target.world_size=4",
             f"output.path={tmp_path / 'out_s3'}"],
            cwd=tmp_path, timeout=400, env=user_env(),
        )
    assert from_s3.returncode == 0, from_s3.stderr[-3000:]
    assert "no model.factory given: the model is built from" in from_s3.stderr
    assert _files(tmp_path / "out_s3") == _files(tmp_path / "out") != {}
    inspected = run_command([sys.executable, "-m", "osdpipe", "inspect", str(checkpoint)], cwd=tmp_path, timeout=120,
                            env=user_env())  # fmt: skip
    command = inspected.stdout.split("convert with ", 1)[1]
    assert inspected.returncode == 0 and "checkpoint=accelerate" in command and "model.factory" not in command, (
        inspected.stdout)
    resumed = accel.trainer(
        tmp_path,
        4,
        {
            **spec,
            "out": str(tmp_path / "resumed"),
            "max_steps": 4,
            "resume": str(folder),
            "dump": str(tmp_path / "loaded.pt"),
        },
        label="resume",
    )
    assert resumed["global_step"] == 4 and resumed["optim_state_after_resume"] > 0 and len(resumed["groups"]) == 2
    saved, loaded = (torch.load(tmp_path / name, weights_only=False) for name in ("saved.pt", "loaded.pt"))
    assert accel.compare(saved, loaded) == []


def _files(directory: Path) -> dict[str, bytes]:
    """A conversion's files and their bytes, without what it writes about itself (paths in it differ)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name not in ("report.json", "osdpipe.log", "manifest.json")}  # fmt: skip
