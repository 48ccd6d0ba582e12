"""The ``ddp`` kind through the ``osdpipe`` command: DDP jobs as source and target, and wrappers' names in a checkpoint.

A DDP job's optimizer holds every parameter whole on every rank; it saves a
``plain`` state dict (or one per rank). Each conversion is compared with
PyTorch's own path for its target: ``FSDP.optim_state_dict_to_load`` for
FSDP1, ``FSDP.rekey_optim_state_dict`` of the unwrapped module for DDP.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conversions import pytorch_says
from helpers import run_osdpipe

from osdpipe.core.compare import diff
from osdpipe.io.loading import without_records
from osdpipe.layout.models import build_model
from osdpipe.run.launch import run_local_world
from osdpipe.spec.reconcile import settle_and_validate

TIMEOUT_S = 240


def explain(result) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def full_from_plain(plain: dict) -> dict:
    """A plain (param-ID keyed) state of the nested model as PyTorch's full FQN-keyed one: IDs follow
    model.parameters()."""
    fqns = [name for name, _ in build_model("nested", {}).named_parameters()]
    return {
        "state": {fqns[i]: s for i, s in plain["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in plain["param_groups"]],
    }


@pytest.fixture(scope="module")
def ddp_to_fsdp1(tmp_path_factory) -> Path:
    """A DDP job on 2 ranks (generated: one plain optim.state_dict()) converted to FSDP1 on 3 ranks with
    use_orig_params."""
    root = tmp_path_factory.mktemp("ddp")
    out = root / "out"
    result = run_osdpipe(
        "source.kind=ddp", "source.world_size=2", "target.kind=fsdp1", "target.world_size=3",
        "target.use_orig_params=true", f"output.path={out}", cwd=root,
    )
    assert result.returncode == 0, explain(result)
    return out


def test_ddp_source_to_fsdp1_matches_pytorch(ddp_to_fsdp1: Path) -> None:
    out = ddp_to_fsdp1
    full = full_from_plain(torch.load(out / "source" / "optim.pt", weights_only=True))
    torch.save(full, out.parent / "full.pt")
    spec = settle_and_validate(
        {"output": {"path": str(out), "overwrite": True}, "target": {"world_size": 3, "use_orig_params": True}}
    )
    problems = run_local_world(pytorch_says, 3, (spec, str(out.parent / "full.pt")), timeout_s=TIMEOUT_S)
    assert problems == [[]] * 3, problems


def test_fsdp1_to_ddp_every_rank_gets_the_unwrapped_state(tmp_path: Path) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    out = tmp_path / "out"
    result = run_osdpipe(
        "source.world_size=3", "target.kind=ddp", "target.world_size=2", f"output.path={out}", cwd=tmp_path
    )
    assert result.returncode == 0, explain(result)
    files = [torch.load(out / f"rank_{r}.pt", weights_only=True) for r in range(2)]
    assert not diff(files[0], files[1]), "DDP ranks hold the same state"
    model = build_model("nested", {})
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = FSDP.rekey_optim_state_dict(
            torch.load(out / "source" / "optim.pt", weights_only=True), OptimStateKeyType.PARAM_ID, model, optim=optim
        )
    assert diff(without_records(files[0]), expected) == []
    # The same state as one plain file, which every DDP rank loads.
    plain_out = tmp_path / "plain"
    result = run_osdpipe(
        f"input.path={out / 'source' / 'optim.pt'}", "target.kind=ddp", "target.world_size=2",
        "output.format=plain", f"output.path={plain_out}", cwd=tmp_path,
    )
    assert result.returncode == 0, explain(result)
    assert diff(without_records(torch.load(plain_out / "optim.pt", weights_only=True)), expected) == []
    # An FQN-keyed full state for a DDP job: verify's reference is get_optimizer_state_dict(full_state_dict=True).
    full_out = tmp_path / "full"
    result = run_osdpipe(
        f"input.path={out / 'source' / 'optim.pt'}", "target.kind=ddp", "target.world_size=2",
        "output.format=fsdp_full", f"output.path={full_out}", cwd=tmp_path,
    )
    assert result.returncode == 0, explain(result)
    got = torch.load(full_out / "optim.pt", weights_only=True)
    source = torch.load(out / "source" / "optim.pt", weights_only=True)
    assert diff(got["state"], source["state"]) == []
    # the DDP optimizer's order
    assert got["param_groups"][0]["params"] == [name for name, _ in model.named_parameters()]


def test_wrappers_names_in_a_checkpoint_are_mapped(ddp_to_fsdp1: Path, tmp_path: Path) -> None:
    """DDP's module., torch.compile's _orig_mod. and activation checkpointing's names convert as the plain names do."""
    full = full_from_plain(torch.load(ddp_to_fsdp1 / "source" / "optim.pt", weights_only=True))

    def wrapped(fqn: str) -> str:
        parts = fqn.split(".")
        if len(parts) > 2:  # inside a block: as checkpoint_wrapper leaves it
            parts.insert(1, "_checkpoint_wrapped_module")
        return "module._orig_mod." + ".".join(parts)

    prefixed = {
        "state": {wrapped(f): s for f, s in full["state"].items()},
        "param_groups": [{**g, "params": [wrapped(f) for f in g["params"]]} for g in full["param_groups"]],
    }
    torch.save(full, tmp_path / "plain_names.pt")
    torch.save(prefixed, tmp_path / "wrapped_names.pt")
    outs = {}
    for name in ("plain_names", "wrapped_names"):
        outs[name] = tmp_path / f"out_{name}"
        result = run_osdpipe(
            f"input.path={tmp_path / name}.pt", "target.world_size=2", f"output.path={outs[name]}", cwd=tmp_path
        )
        assert result.returncode == 0, explain(result)
    for r in range(2):
        plain_file, wrapped_file = outs["plain_names"] / f"rank_{r}.pt", outs["wrapped_names"] / f"rank_{r}.pt"
        assert plain_file.read_bytes() == wrapped_file.read_bytes()


def test_layouts_that_cannot_hold_a_format_are_refused(tmp_path: Path) -> None:
    refused = run_osdpipe("output.format=plain", f"output.path={tmp_path / 'a'}", cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "output.format=plain" in refused.stderr and "ddp" in refused.stderr, (
        explain(refused)
    )
    refused = run_osdpipe(
        "source.kind=ddp", "source.state_dict_type=sharded", f"output.path={tmp_path / 'b'}", cwd=tmp_path, timeout=60
    )
    assert refused.returncode == 2 and "source.state_dict_type=sharded" in refused.stderr, explain(refused)
    assert "config: config:" not in refused.stderr
