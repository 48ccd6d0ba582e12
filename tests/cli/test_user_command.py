"""The README's "Your own model" and "Your own checkpoint", followed literally through the ``osdpipe`` command.

A model osdpipe has never seen (``userlm:build``: token IDs into an
``nn.Embedding``, a tied head, parameters that share a shape, a factory
without arguments, no ``example_input``) is trained and checkpointed by plain
PyTorch FSDP1 code on 4 ranks, in every input format, and by plain FSDP2 code
(``fully_shard``, ``get_optimizer_state_dict`` + ``dcp.save``). Each is
converted by the command with only ``model.factory``, ``input.*``,
``source.*``, ``target.*`` and ``output.*`` given, and every rank file is
compared bitwise with PyTorch's own path for a target job of that shape,
computed here independently of osdpipe: ``FSDP.optim_state_dict_to_load``
for FSDP1, ``set_optimizer_state_dict`` from the full state then
``optim.state_dict()`` for FSDP2. FSDP2 files are then loaded with
``osdpipe.load_rank_local`` and stepped.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_cli_cases, run_command, user_env

from osdpipe.core.compare import diff
from osdpipe.io.loading import without_records
from osdpipe.run.launch import run_local_world

#: End to end: it starts worlds, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

TIMEOUT_S = 240


def _wrap(model: torch.nn.Module, units: set[type], use_orig_params: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy(units) if units else None,
            use_orig_params=use_orig_params,
            device_id=torch.device("cpu"),
        )


def _train_and_save(root: str) -> None:
    """A user's training job: FSDP1 over MixerBlock units on 4 ranks, Adam, 3 steps on token IDs; then every format."""
    import torch.distributed.checkpoint as dcp
    import userlm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _wrap(userlm.build(), {userlm.MixerBlock}, use_orig_params=False)
    optim = userlm.train(model, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = FSDP.optim_state_dict(model, optim)
        if rank == 0:
            torch.save(full, os.path.join(root, "optim.pt"))
        os.makedirs(os.path.join(root, "rank_local"), exist_ok=True)
        torch.save(optim.state_dict(), os.path.join(root, "rank_local", f"rank_{rank}.pt"))
        with FSDP.state_dict_type(
            model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
        ):
            sharded = FSDP.optim_state_dict(model, optim)
        dcp.save({"optimizer": sharded}, checkpoint_id=os.path.join(root, "dcp"))


def _fully_shard(model: torch.nn.Module, shard_group_size: int | None = None) -> torch.nn.Module:
    """A user's FSDP2 wrapping: fully_shard on every MixerBlock, then the root; HSDP on a (replicate, shard) mesh."""
    import userlm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    shape = (world // shard_group_size, shard_group_size) if shard_group_size else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    for block in model.modules():
        if isinstance(block, userlm.MixerBlock):
            fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train_fsdp2_and_save(root: str) -> None:
    """A user's FSDP2 job on 4 ranks: 3 Adam steps, then get_optimizer_state_dict + dcp.save,
    and the full state for reference."""
    import torch.distributed.checkpoint as dcp
    import userlm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = _fully_shard(userlm.build())
    optim = userlm.train(model, steps=3)
    dcp.save({"optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=os.path.join(root, "fsdp2_dcp"))
    full = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(root, "fsdp2_full.pt"))


def _save_jobs(root: str) -> None:
    _train_and_save(root)
    _train_fsdp2_and_save(root)


def _save_plain(root: Path) -> None:
    """An unwrapped job's own optim.state_dict(), param-ID keyed (one process, no FSDP)."""
    import userlm

    torch.manual_seed(0)
    model = userlm.build()
    optim = userlm.train(model, steps=2)
    torch.save(optim.state_dict(), root / "plain.pt")
    # The same state keyed by FQN, as PyTorch's FSDP conversion takes it (the reference for this input).
    torch.save(userlm.fqn_keyed(model, optim), root / "plain_as_full.pt")


@pytest.fixture(scope="module")
def user_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user_job")
    run_local_world(_save_jobs, 4, (str(root),), timeout_s=TIMEOUT_S)
    _save_plain(root)
    return root


def _pytorch_rank_files_match(
    out: str, full_path: str, units: list[str], use_orig_params: bool, hybrid: int | None = None
) -> list[str]:
    """On each target rank: osdpipe's rank file against FSDP.optim_state_dict_to_load, bitwise."""
    import userlm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size() // hybrid, hybrid), mesh_dim_names=("replicate", "shard"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FSDP(
                userlm.build(),
                device_mesh=mesh,
                sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                use_orig_params=use_orig_params,
                device_id=torch.device("cpu"),
            )
    else:
        model = _wrap(userlm.build(), {getattr(userlm, u) for u in units}, use_orig_params)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = FSDP.optim_state_dict_to_load(model, optim, torch.load(full_path, weights_only=True))
    got = torch.load(os.path.join(out, f"rank_{dist.get_rank()}.pt"), weights_only=True)
    return diff(without_records(got), expected)


def _pytorch_fsdp2_rank_files_match(out: str, full_path: str, shard_group_size: int | None) -> list[str]:
    """On each FSDP2 target rank: osdpipe's file against set_optimizer_state_dict(full) + optim.state_dict(); then load
    it and step."""
    import userlm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    import osdpipe

    torch.manual_seed(1)
    model = _fully_shard(userlm.build(), shard_group_size)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    set_optimizer_state_dict(
        model, optim, torch.load(full_path, weights_only=True), options=StateDictOptions(full_state_dict=True)
    )
    expected = optim.state_dict()
    path = os.path.join(out, f"rank_{dist.get_rank()}.pt")
    got = torch.load(path, weights_only=True)
    local = {
        pid: {n: v.to_local() if isinstance(v, DTensor) else v for n, v in s.items()}
        for pid, s in expected["state"].items()
    }
    problems = diff(got["state"], local, path="state") + diff(
        got["param_groups"], expected["param_groups"], path="param_groups", sequence_types=False
    )
    placements = {pid: [str(p) for p in v["exp_avg"].placements] for pid, v in expected["state"].items()}
    problems += diff({pid: e["placements"] for pid, e in got["dtensor"].items()}, placements, path="dtensor")
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    osdpipe.load_rank_local(fresh, path)  # the README's one call
    tokens = torch.randint(0, userlm.VOCAB, (4, 5), generator=torch.Generator().manual_seed(7))
    model(tokens).float().pow(2).mean().backward()
    fresh.step()
    for state in fresh.state.values():
        for name, value in state.items():
            local_value = value.to_local() if isinstance(value, DTensor) else value
            if not bool(torch.isfinite(local_value).all()):
                problems.append(f"{name} is not finite after a step")
    return problems


# (case, README command arguments after model.factory, target world size, target units, use_orig_params)
CASES = [
    (
        "fsdp_full_to_2",
        [
            "input.path={root}/optim.pt", "input.format=fsdp_full",
            "source.world_size=4", "source.wrap=[MixerBlock]",
            "target.world_size=2",
        ],
        2,
        [],
        False,
    ),
    (
        "fsdp_full_to_3",
        [
            "input.path={root}/optim.pt",
            "source.world_size=4", "source.wrap=[MixerBlock]",
            "target.world_size=3", "target.wrap=[MixerBlock]", "target.use_orig_params=true",
        ],
        3,
        ["MixerBlock"],
        True,
    ),
    (
        "dcp_to_2",
        [
            "input.path={root}/dcp", "input.format=dcp", "input.key=optimizer",
            "source.world_size=4", "source.wrap=[MixerBlock]",
            "target.world_size=2",
        ],
        2,
        [],
        False,
    ),
    (
        "rank_local_to_3",
        [
            "input.path={root}/rank_local", "input.format=rank_local",
            "source.world_size=4", "source.wrap=[MixerBlock]",
            "target.world_size=3", "target.use_orig_params=true",
        ],
        3,
        [],
        True,
    ),
    (
        "plain_to_2",
        [
            "input.path={root}/plain.pt", "input.format=plain",
            "source.kind=none", "source.world_size=1", "input.param_groups=[[*]]",
            "target.world_size=2", "target.wrap=[MixerBlock]",
        ],
        2,
        ["MixerBlock"],
        False,
    ),
]


def _check_converted(name: str, result: dict, out: Path, world: int) -> None:
    """The README command passed every check and wrote ``world`` rank files."""
    assert result["code"] == 0, f"{name}: exit {result['code']}\n{result['stdout']}\n{result['stderr']}"
    assert "Traceback" not in result["stderr"] and "error" not in result["stderr"], result["stderr"]
    for check in ("roundtrip", "reference", "load_step"):
        assert f"check {check:<10} pass" in result["stdout"], result["stdout"]
    assert sorted(p.name for p in out.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(world)]


def _convert(args: list[str], root: Path, tmp_path: Path, world: int) -> Path:
    """Run the README command with ``args`` in a process of its own; it must pass every check and write ``world`` rank
    files, nothing else."""
    out = tmp_path / "resharded"
    cmd = [
        sys.executable, "-m", "osdpipe", "model.factory=userlm:build", *(a.format(root=root) for a in args),
        f"output.path={out}",
    ]
    result = run_command(cmd, cwd=tmp_path, timeout=TIMEOUT_S, env=user_env())
    _check_converted(
        "command", {"code": result.returncode, "stdout": result.stdout, "stderr": result.stderr}, out, world
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resharded"], "nothing is written outside output.path"
    return out


@pytest.mark.parametrize("case,args,world,units,use_orig_params", CASES, ids=[c[0] for c in CASES])
def test_readme_command_converts_a_user_checkpoint(
    case, args, world, units, use_orig_params, user_checkpoints, converted
):
    out = converted[case]
    reference = user_checkpoints / ("plain_as_full.pt" if case.startswith("plain") else "optim.pt")
    problems = run_local_world(
        _pytorch_rank_files_match, world, (str(out), str(reference), units, use_orig_params), timeout_s=TIMEOUT_S
    )
    assert problems == [[]] * world, problems


# FSDP1 -> FSDP2, with and without HSDP: (case, arguments, target world size, shard_group_size)
TO_FSDP2 = [
    ("fsdp1_to_fsdp2_2", ["target.world_size=2"], 2, None),
    ("fsdp1_to_fsdp2_3", ["target.world_size=3"], 3, None),
    ("fsdp1_to_hsdp_4", ["target.world_size=4", "target.shard_group_size=2"], 4, 2),
]


@pytest.mark.parametrize("case,args,world,shard_group_size", TO_FSDP2, ids=[c[0] for c in TO_FSDP2])
def test_fsdp1_checkpoint_converts_to_fsdp2(case, args, world, shard_group_size, user_checkpoints, converted):
    out = converted[case]
    problems = run_local_world(
        _pytorch_fsdp2_rank_files_match,
        world,
        (str(out), str(user_checkpoints / "optim.pt"), shard_group_size),
        timeout_s=TIMEOUT_S,
    )
    assert problems == [[]] * world, problems


# FSDP2 DCP -> FSDP1: (case, arguments, target world size, use_orig_params, shard_group_size)
FROM_FSDP2 = [
    (
        "fsdp2_dcp_to_orig_params_4",
        ["target.world_size=4", "target.use_orig_params=true", "target.wrap=[MixerBlock]"],
        4,
        True,
        None,
    ),
    (
        "fsdp2_dcp_to_hybrid_4",
        ["target.world_size=4", "target.wrap=[]", "target.sharding_strategy=HYBRID_SHARD", "target.shard_group_size=2"],
        4,
        False,
        2,
    ),
]


TO_FSDP2_SOURCE = [
    "input.path={root}/optim.pt", "input.format=fsdp_full", "source.world_size=4", "source.wrap=[MixerBlock]",
    "target.kind=fsdp2",
]
FROM_FSDP2_SOURCE = [
    "input.path={root}/fsdp2_dcp", "input.format=dcp", "source.kind=fsdp2", "source.world_size=4", "target.kind=fsdp1"
]


@pytest.fixture(scope="module")
def converted(user_checkpoints: Path, tmp_path_factory) -> dict[str, Path]:
    """Every case's README command, through the ``osdpipe`` entry point in one driver process:
    case -> its output directory.

    Each must pass every check and write its rank files; nothing is written outside the output directories.
    """
    work = tmp_path_factory.mktemp("commands")
    cases = {name: (args, world) for name, args, world, *_ in CASES}
    cases |= {name: ([*TO_FSDP2_SOURCE, *args], world) for name, args, world, _ in TO_FSDP2}
    cases |= {name: ([*FROM_FSDP2_SOURCE, *args], world) for name, args, world, *_ in FROM_FSDP2}
    outs = {name: work / name for name in cases}
    argv = [
        ["model.factory=userlm:build", *(a.format(root=user_checkpoints) for a in args), f"output.path={outs[name]}"]
        for name, (args, _) in cases.items()
    ]
    results = run_cli_cases(argv, cwd=work, per_case_s=TIMEOUT_S, env=user_env())
    for (name, (_, world)), result in zip(cases.items(), results):
        _check_converted(name, result, outs[name], world)
    assert sorted(p.name for p in work.iterdir()) == sorted(cases), "nothing is written outside output.path"
    return outs


@pytest.mark.parametrize("case,args,world,use_orig_params,hybrid", FROM_FSDP2, ids=[c[0] for c in FROM_FSDP2])
def test_fsdp2_dcp_checkpoint_converts_to_fsdp1(
    case, args, world, use_orig_params, hybrid, user_checkpoints, converted
):
    out = converted[case]
    units = [] if hybrid else ["MixerBlock"]
    full = str(user_checkpoints / "fsdp2_full.pt")
    problems = run_local_world(
        _pytorch_rank_files_match, world, (str(out), full, units, use_orig_params, hybrid), timeout_s=TIMEOUT_S
    )
    assert problems == [[]] * world, problems


def _save_fsdp2_state_dicts(root: str) -> None:
    """A user's FSDP2 job saving each rank's optim.state_dict() as it is (DTensors),
    and the full state for reference."""
    import userlm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = _fully_shard(userlm.build())
    optim = userlm.train(model, steps=1)
    os.makedirs(os.path.join(root, "fsdp2_rank_local"), exist_ok=True)
    torch.save(optim.state_dict(), os.path.join(root, "fsdp2_rank_local", f"rank_{dist.get_rank()}.pt"))
    full = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(root, "fsdp2_rank_local_full.pt"))


def test_fsdp2_rank_state_dicts_with_dtensors_convert(tmp_path):
    """Each FSDP2 rank's plain torch.save(optim.state_dict()) (pickled DTensors) is a rank_local input."""
    root = tmp_path / "job"
    root.mkdir()
    run_local_world(_save_fsdp2_state_dicts, 2, (str(root),), timeout_s=TIMEOUT_S)
    work = tmp_path / "work"
    work.mkdir()
    args = [
        "input.path={root}/fsdp2_rank_local", "input.format=rank_local", "source.kind=fsdp2", "source.world_size=2",
        "target.kind=fsdp1", "target.world_size=3", "target.use_orig_params=true",
    ]
    out = _convert(args, root, work, 3)
    problems = run_local_world(
        _pytorch_rank_files_match, 3, (str(out), str(root / "fsdp2_rank_local_full.pt"), [], True), timeout_s=TIMEOUT_S
    )
    assert problems == [[]] * 3, problems
