"""Real DeepSpeed saves ZeRO checkpoints, the ``osdpipe`` command converts them for PyTorch jobs (issue 31).

DeepSpeed 0.19.8 trains the tests' own model (:mod:`frameworks.ds_job`: odd
sizes so ZeRO's padding shows, two param groups, tied embeddings or not) on
2 CPU ranks and calls ``engine.save_checkpoint``; the same job gathers what it
held at that moment through DeepSpeed's own API (:mod:`frameworks.ds`). osdpipe
reads the save folder without DeepSpeed's code (``input.format=deepspeed``,
found by itself) and writes it for an FSDP2 job on 3 ranks; its own checks load
the output into that job with PyTorch's ``set_optimizer_state_dict`` and step
it. The output, gathered whole, holds DeepSpeed's moments and step bit for bit,
each under the parameter's name, in DeepSpeed's param groups (the truth is
DeepSpeed's API, or its ``ds_to_universal`` where the API has no moments:
in stage 1/2 DeepSpeed links them after the first group's first step, so the
second group's are never linked; see :mod:`frameworks.ds_job`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from frameworks import ds
from osdpipe.formats.deepspeed import ZeroReader
from helpers import run_command, user_env

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

#: Each ZeRO stage once, in both precisions and with tied embeddings on and off between them.
SAVES = {
    "stage1-fp32": {"stage": 1, "dtype": "fp32", "tied": False},
    "stage2-bf16-tied": {"stage": 2, "dtype": "bf16", "tied": True},
    "stage3-bf16-tied": {"stage": 3, "dtype": "bf16", "tied": True},
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _gathered_output(dcp_dir: Path, work: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = work / "gathered.pt"
    dcp_to_torch_save(str(dcp_dir), str(whole))
    return torch.load(whole, weights_only=True)["optim"]


@pytest.mark.parametrize("name", list(SAVES))
def test_a_zero_save_converts_for_an_fsdp2_job_with_deepspeeds_state_bit_for_bit(tmp_path: Path, name: str) -> None:
    spec = SAVES[name]
    folder = ds.save(tmp_path, 2, {**spec, "out": str(tmp_path / "ckpt"), "steps": 2})
    truth = torch.load(ds.dump_path(folder), weights_only=False)
    out = tmp_path / "out"
    done = run_command(
        [sys.executable, "-m", "osdpipe", f"input.path={folder}", "model.factory=frameworks.ds_job:DsLM", f"+model.kwargs.tied={str(spec['tied']).lower()}",
         "target.kind=fsdp2", "target.world_size=3", "output.format=dcp", f"output.path={out}"],
        cwd=tmp_path, timeout=400, env=user_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {c["name"]: c["ok"] for c in report["checks"]} == {"roundtrip": True, "reference": True, "load_step": True, "resume": True}

    got = _gathered_output(out / "dcp", tmp_path)
    assert set(got["state"]) == set(truth["state"]), "every optimized parameter, tied ones once"
    wrong = [
        f"{fqn}.{key}" for fqn, want in truth["state"].items() for key in ("exp_avg", "exp_avg_sq")
        if got["state"][fqn][key].shape != want[key].shape or not torch.equal(_bits(got["state"][fqn][key]), _bits(want[key]))
    ]
    assert wrong == []
    assert all(float(got["state"][fqn]["step"]) == float(want["step"]) for fqn, want in truth["state"].items())
    groups = [(sorted(g["params"]), g["weight_decay"], g["lr"]) for g in got["param_groups"]]
    assert groups == [(sorted(g["params"]), g["weight_decay"], g["lr"]) for g in truth["param_groups"]]

    # the fp32 master weights, read from the same files, are DeepSpeed's own (the model a conversion will carry); training moved
    # every one, so in bf16 they are not the bf16 weights the model-states file holds
    assert all(not torch.equal(truth["fp32"][fqn], truth["initial"][fqn].float()) for fqn in truth["fp32"])
    reader = ZeroReader(str(folder))
    masters = reader.read([(fqn, "fp32") for fqn in truth["fp32"]])
    assert [fqn for fqn, want in truth["fp32"].items() if not torch.equal(_bits(masters[(fqn, "fp32")]), _bits(want))] == []
