"""``checkpoint=pytorch``: PyTorch's own layout,
``dcp.save({"model": get_model_state_dict, "optim": get_optimizer_state_dict})``, in and out.

The source is what PyTorch itself saves: with no ``input.path`` the source
world (FSDP2, 2 gloo ranks, the user's model with a tied embedding and a
persistent buffer) trains and saves it with those calls, and the conversion
commits it beside the output. The output, loaded by a PyTorch job on 3 ranks
(``dcp.load`` then ``set_model_state_dict`` and ``set_optimizer_state_dict``:
the ``load_step`` and ``resume`` checks), must pass every check; gathered
whole, it holds the source's model and optimizer bit for bit. ``inspect``
names the layout, and the command it prints converts the source again.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_command, user_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 300


def _gathered(dcp_dir: Path, work: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = work / f"{dcp_dir.parent.name}-{dcp_dir.name}.pt"
    dcp_to_torch_save(str(dcp_dir), str(whole))
    return torch.load(whole, weights_only=True)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _osdpipe(args: list[str], cwd: Path) -> None:
    done = run_command([sys.executable, "-m", "osdpipe", *args], cwd=cwd, timeout=TIMEOUT_S, env=user_env())
    assert done.returncode == 0, done.stderr[-3000:]


def test_pytorchs_own_layout_converts_for_another_world_and_holds_the_source_bit_for_bit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _osdpipe(["checkpoint=pytorch", "model.factory=userlm:build", "source.kind=fsdp2", "source.world_size=2",
              "target.kind=fsdp2", "target.world_size=3", f"output.path={out}"], tmp_path)
    report = json.loads((out / "report.json").read_text())
    assert {c["name"]: c["ok"] for c in report["checks"]} == {
        "roundtrip": True, "reference": True, "load_step": True, "resume": True
    }

    source, converted = _gathered(out / "source" / "checkpoint", tmp_path), _gathered(out / "dcp", tmp_path)
    assert set(converted) == set(source) == {"model", "optim"}
    import userlm

    assert set(converted["model"]) == set(userlm.build().state_dict()), (
        "every name of the model's state dict, the tied weight's both, the buffer"
    )
    assert [k for k, v in source["model"].items() if not _bits_equal(converted["model"][k], v)] == []
    wrong = [f"{fqn}.{name}" for fqn, state in source["optim"]["state"].items() for name, v in state.items()
             if not _bits_equal(converted["optim"]["state"][fqn][name], v)]
    assert wrong == [] and set(converted["optim"]["state"]) == set(source["optim"]["state"])
    assert converted["optim"]["param_groups"] == source["optim"]["param_groups"]

    shown = run_command(
        [sys.executable, "-m", "osdpipe", "inspect", str(out / "source" / "checkpoint"), "--json"],
        cwd=tmp_path,
        timeout=TIMEOUT_S,
        env=user_env(),
    )
    assert shown.returncode == 0, shown.stderr
    whole = json.loads(shown.stdout)["checkpoint"]
    assert whole["layout"] == "pytorch" and (whole["optimizer_key"], whole["optimizer_keys"]) == ("optim", "nested")
    assert {e["name"].removeprefix("model.") for e in whole["entries"] if e["part"] == "model"} == set(source["model"])
    command = (
        whole["command"]
        .replace("PACKAGE.MODULE:FUNCTION", "userlm:build")
        .replace("target.world_size=M", "target.world_size=2")
        .replace("OUT_DIR", str(tmp_path / "again"))
    )
    extra = ["target.kind=ddp", "runtime.mode=offline", "output.format=rank_local"]
    _osdpipe([*shlex.split(command)[1:], *extra], tmp_path)  # as a shell splits it: 'source.wrap=[]' is quoted
    again = torch.load(tmp_path / "again" / "rank_1.pt", weights_only=True)
    assert [k for k, v in source["model"].items() if not _bits_equal(again["model"][k], v)] == [], (
        "DDP: every rank holds the whole model"
    )
