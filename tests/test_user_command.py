"""The README's "Your own model" and "Your own checkpoint", followed literally through the ``osdpipe`` command.

A model osdpipe has never seen (``userlm:build``: token IDs into an
``nn.Embedding``, a tied head, parameters that share a shape, a factory
without arguments, no ``example_input``) is trained and checkpointed by plain
PyTorch FSDP1 code on 4 ranks, in every input format. Each is converted by
the command with only ``model.factory``, ``input.*``, ``source.*``,
``target.*`` and ``output.*`` given, and every rank file is compared bitwise
with what ``FSDP.optim_state_dict_to_load`` gives a target job of that shape,
computed here independently of osdpipe.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import clean_env, run_command

from osdpipe.compare import diff
from osdpipe.launch import run_local_world

TIMEOUT_S = 240
TESTS = Path(__file__).resolve().parent


def _wrap(model: torch.nn.Module, units: set[type], use_orig_params: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(units) if units else None, use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def _train_and_save(root: str) -> None:
    """A user's training job: FSDP1 over MixerBlock units on 4 ranks, Adam, 3 steps on token IDs; then every format."""
    import torch.distributed.checkpoint as dcp
    import userlm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _wrap(userlm.build(), {userlm.MixerBlock}, use_orig_params=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(3):
        tokens = torch.randint(0, userlm.VOCAB, (4, 5), generator=torch.Generator().manual_seed(step))
        model(tokens).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = FSDP.optim_state_dict(model, optim)
        if rank == 0:
            torch.save(full, os.path.join(root, "optim.pt"))
        os.makedirs(os.path.join(root, "rank_local"), exist_ok=True)
        torch.save(optim.state_dict(), os.path.join(root, "rank_local", f"rank_{rank}.pt"))
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()):
            sharded = FSDP.optim_state_dict(model, optim)
        dcp.save({"optimizer": sharded}, checkpoint_id=os.path.join(root, "dcp"))


def _save_plain(root: Path) -> None:
    """An unwrapped job's own optim.state_dict(), param-ID keyed (one process, no FSDP)."""
    import userlm

    torch.manual_seed(0)
    model = userlm.build()
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(2):
        tokens = torch.randint(0, userlm.VOCAB, (4, 5), generator=torch.Generator().manual_seed(step))
        model(tokens).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    torch.save(optim.state_dict(), root / "plain.pt")
    # The same state keyed by FQN, as PyTorch's FSDP conversion takes it (the reference for this input).
    fqns = [name for name, _ in model.named_parameters()]
    state = optim.state_dict()
    full = {"state": {fqns[i]: s for i, s in state["state"].items()}, "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in state["param_groups"]]}
    torch.save(full, root / "plain_as_full.pt")


@pytest.fixture(scope="module")
def user_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user_job")
    run_local_world(_train_and_save, 4, (str(root),), timeout_s=TIMEOUT_S)
    _save_plain(root)
    return root


def _pytorch_rank_files_match(out: str, full_path: str, units: list[str], use_orig_params: bool) -> list[str]:
    """On each target rank: osdpipe's rank file against FSDP.optim_state_dict_to_load, bitwise."""
    import userlm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _wrap(userlm.build(), {getattr(userlm, u) for u in units}, use_orig_params)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = FSDP.optim_state_dict_to_load(model, optim, torch.load(full_path, weights_only=True))
    got = torch.load(os.path.join(out, f"rank_{dist.get_rank()}.pt"), weights_only=True)
    return diff(got, expected)


# (case, README command arguments after model.factory, target world size, target units, use_orig_params)
CASES = [
    ("fsdp_full_to_2", ["input.path={root}/optim.pt", "input.format=fsdp_full", "source.world_size=4", "source.wrap=[MixerBlock]", "target.world_size=2"], 2, [], False),
    (
        "fsdp_full_to_3",
        ["input.path={root}/optim.pt", "source.world_size=4", "source.wrap=[MixerBlock]", "target.world_size=3", "target.wrap=[MixerBlock]", "target.use_orig_params=true"],
        3,
        ["MixerBlock"],
        True,
    ),
    ("dcp_to_2", ["input.path={root}/dcp", "input.format=dcp", "input.key=optimizer", "source.world_size=4", "source.wrap=[MixerBlock]", "target.world_size=2"], 2, [], False),
    (
        "rank_local_to_3",
        ["input.path={root}/rank_local", "input.format=rank_local", "source.world_size=4", "source.wrap=[MixerBlock]", "target.world_size=3", "target.use_orig_params=true"],
        3,
        [],
        True,
    ),
    (
        "plain_to_2",
        ["input.path={root}/plain.pt", "input.format=plain", "source.kind=none", "source.world_size=1", "input.param_groups=[[*]]", "target.world_size=2", "target.wrap=[MixerBlock]"],
        2,
        ["MixerBlock"],
        False,
    ),
]


@pytest.mark.parametrize("case,args,world,units,use_orig_params", CASES, ids=[c[0] for c in CASES])
def test_readme_command_converts_a_user_checkpoint(case, args, world, units, use_orig_params, user_checkpoints, tmp_path):
    out = tmp_path / "resharded"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])  # the user's package is importable
    cmd = [sys.executable, "-m", "osdpipe", "model.factory=userlm:build", *(a.format(root=user_checkpoints) for a in args), f"output.path={out}"]
    result = run_command(cmd, cwd=tmp_path, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr and "error" not in result.stderr, result.stderr
    for check in ("roundtrip", "reference", "load_step"):
        assert f"check {check:<10} pass" in result.stdout, result.stdout
    assert sorted(p.name for p in out.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(world)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resharded"], "nothing is written outside output.path"
    reference = user_checkpoints / ("plain_as_full.pt" if case.startswith("plain") else "optim.pt")
    problems = run_local_world(_pytorch_rank_files_match, world, (str(out), str(reference), units, use_orig_params), timeout_s=TIMEOUT_S)
    assert problems == [[]] * world, problems
