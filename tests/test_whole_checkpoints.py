"""Whole training checkpoints (issue 19, first part): ``osdpipe inspect`` names every entry of a torchtitan and an accelerate checkpoint.

The checkpoints are written by plain PyTorch code as the frameworks lay them
out (``whole_jobs.py``: FSDP2 and FSDP1 on 4 gloo ranks, the user's tied
model, Adam with a ``LambdaLR``). The command must say which layout it is,
where the model and the optimizer are, and list every other entry with its
size, marking those that belong to one source rank; nothing in the folder
may go unnamed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import clean_env, run_command
from oracle_probe import spawn_world
import whole_jobs

#: End to end: three 4-rank worlds save the checkpoints.
pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
TIMEOUT_S = 180


def _inspect(path: Path, *extra: str) -> dict:
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    result = run_command([sys.executable, "-m", "osdpipe", "inspect", str(path), *extra], cwd=path.parent, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if "--json" in extra else {"text": result.stdout}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("whole")
    spawn_world(whole_jobs.save_torchtitan, 4, (str(root / "titan"),), timeout_s=TIMEOUT_S)
    spawn_world(whole_jobs.save_torchtitan, 4, (str(root / "titan_v01"), True), timeout_s=TIMEOUT_S)
    spawn_world(whole_jobs.save_accelerate, 4, (str(root / "accelerate"),), timeout_s=TIMEOUT_S)
    return root


def _model_keys() -> set[str]:
    import userlm

    return set(userlm.build().state_dict())  # both names of the tied weight, as get_model_state_dict gives them


@pytest.mark.parametrize("folder", ["titan", "titan_v01"])
def test_a_torchtitan_step_lists_its_model_optimizer_and_every_other_entry(saved: Path, folder: str) -> None:
    shown = _inspect(saved / folder / "step-2", "--json")
    whole = shown["checkpoint"]
    assert whole["layout"] == "torchtitan"
    names = {e["name"]: e for e in whole["entries"]}
    model = {n.removeprefix("model.") for n, e in names.items() if e["part"] == "model"}
    assert model == _model_keys()
    assert [n for n, e in names.items() if e["part"] == "optimizer"] == ["optimizer"] and names["optimizer"]["tensors"] == 3 * 13
    others = {n for n, e in names.items() if e["part"] == "other"}
    assert others == {*whole_jobs.TITAN_OTHER, *(f"dataloader.dp_rank_{r}" for r in range(4)), "dataloader.world_size"} - {"dataloader"}
    assert {n: e["source_rank"] for n, e in names.items() if e["source_rank"] is not None} == {f"dataloader.dp_rank_{r}": r for r in range(4)}
    assert all(e["size"] > 0 for e in names.values())
    assert (whole["optimizer_key"], whole["optimizer_keys"]) == ("optimizer", "flat")
    assert any("exp_avg, exp_avg_sq, step for 13 parameter(s)" in n for n in whole["notes"])
    assert any("nested under 'model'" in n for n in whole["notes"]) == (folder == "titan_v01")


def test_an_accelerate_folder_lists_every_file_and_reads_its_optimizer(saved: Path) -> None:
    folder = saved / "accelerate" / "checkpoint_0"
    shown = _inspect(folder, "--json")
    whole = shown["checkpoint"]
    assert whole["layout"] == "accelerate"
    names = {e["name"]: e for e in whole["entries"]}
    assert set(names) == {p.name for p in folder.iterdir()}, "every file and directory of the folder is named"
    assert {n for n, e in names.items() if e["part"] == "model"} == {"pytorch_model_fsdp_0"}
    assert {n for n, e in names.items() if e["part"] == "optimizer"} == {"optimizer_0"}
    assert {n for n, e in names.items() if e["part"] == "other"} == set(whole_jobs.ACCELERATE_FILES)
    assert {n: e["source_rank"] for n, e in names.items() if e["source_rank"] is not None} == {f"random_states_{r}.pkl": r for r in range(4)}
    assert all(names[n]["size"] == (folder / n).stat().st_size for n in whole_jobs.ACCELERATE_FILES)
    optimizer = shown["optimizer"]
    assert (optimizer["format"], optimizer["key"], optimizer["world_size"], optimizer["optimizer"], optimizer["params"]) == ("dcp", "optimizer", 4, "Adam", 13)
    text = _inspect(folder)["text"]
    assert "layout       accelerate" in text and "not carried over yet" in text and "random_states_3.pkl" in text


@pytest.mark.parametrize("folder", ["titan", "titan_v01"])
def test_a_torchtitan_optimizer_converts_and_equals_the_jobs_own_full_state(saved: Path, folder: str) -> None:
    """The flattened optimizer entry (``state.<fqn>.<name>``) reads as any DCP optimizer state: to one process, it is what the job reported."""
    import torch

    import userlm

    out = saved / f"{folder}_plain"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    args = ["model.factory=userlm:build", f"input.path={saved / folder / 'step-2'}", "source.kind=fsdp2", "target.kind=none", "target.world_size=1",
            "output.format=plain", "pipeline.checks=[roundtrip,reference,resume]", f"output.path={out}", "runtime.progress=false"]
    result = run_command([sys.executable, "-m", "osdpipe", *args], cwd=saved, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr
    full = torch.load(saved / folder / "full_optim.pt", weights_only=True)
    model = userlm.build()
    optim = torch.optim.Adam(model.parameters(), lr=1.0)
    optim.load_state_dict(torch.load(out / "optim.pt", weights_only=True))
    assert optim.param_groups[0]["lr"] == full["param_groups"][0]["lr"] != 1.0  # the scheduler's lr, kept from the source
    for name, param in model.named_parameters():
        for key, value in full["state"][name].items():
            assert torch.equal(optim.state[param][key], value), f"{name} {key}"
