"""The conversion matrix of layout kinds, every rank's output held against PyTorch.

Model: ``userlm:build`` (token IDs into an ``nn.Embedding``, a head tied to it,
``MixerBlock`` units whose ``wq``/``wk`` share a shape), Adam.

Sources, written by plain PyTorch code (no osdpipe wrapping or saving) in one
spawned world of 4 ranks, each trained a few steps with a real forward and
backward on token batches, from the same seed:

* ``none``: the unwrapped model on rank 0, ``torch.save(optim.state_dict())`` (``plain``);
* ``ddp``: ``DistributedDataParallel``, rank 0's ``optim.state_dict()`` (``plain``);
* ``fsdp1``: ``FullyShardedDataParallel`` FULL_SHARD over ``MixerBlock`` units,
  ``FSDP.optim_state_dict`` with FULL_STATE_DICT (``fsdp_full``), and every
  rank's ``optim.state_dict()`` (``rank_local``);
* ``fsdp1_hybrid``: FSDP1 HYBRID_SHARD on a 2x2 device mesh, every rank's
  ``optim.state_dict()`` (``rank_local``);
* ``fsdp2``: ``fully_shard`` on each ``MixerBlock`` then the root,
  ``dcp.save({"optim": get_optimizer_state_dict(model, optim)})`` (``dcp``);
* ``fsdp2_hsdp``: ``fully_shard`` on a 2x2 (replicate, shard) mesh,
  ``osdpipe.to_rank_local(optim.state_dict())`` per rank (``rank_local``, the
  documented way to save it) and ``dcp``.

Each source also saves its full FQN-keyed state as PyTorch reports it (the
ground truth): ``get_optimizer_state_dict(..., full_state_dict=True)`` for
``none``, ``ddp`` and FSDP2, ``FSDP.optim_state_dict`` FULL for FSDP1.

Every source converts (:func:`osdpipe.pipeline.execute.run_rank`, osdpipe's own
verify on) to every target: ``none`` (1 rank, ``plain``), ``ddp`` (2 ranks),
``fsdp1`` (2 ranks, ``use_orig_params``), ``fsdp1`` HYBRID_SHARD (4 ranks,
shard groups of 2), ``fsdp2`` (2 ranks), ``fsdp2`` HSDP (4 ranks, shard groups
of 2); plus a few cases from the second input of a source and with ``dcp``
output for FSDP2 targets. One world per target world size converts all its
cases, then on every rank, independently of osdpipe, holds the output against
PyTorch's conversion of the ground truth on a target built by plain code:

* ``fsdp1``: bitwise ``FSDP.optim_state_dict_to_load``;
* ``fsdp2``: ``set_optimizer_state_dict(full_state_dict=True)`` then
  ``optim.state_dict()``, DTensors as their local tensors (and the file's
  ``dtensor`` table against the live parameters' mesh and placements), tensors
  bitwise, lists and tuples alike in param groups;
* ``none`` / ``ddp``: bitwise ``FSDP.rekey_optim_state_dict`` by param ID;
* ``dcp`` output on FSDP2: ``dcp.load`` into ``get_optimizer_state_dict``,
  ``set_optimizer_state_dict``, then the full state equals the ground truth;
* then the target optimizer loads the output (``osdpipe.load_rank_local`` or
  ``load_state_dict``), holds exactly PyTorch's state, takes 2 steps with a
  real forward and backward, and every state stays finite; and osdpipe's
  report says ok.

A sensitivity test flips one element of a converted tensor and checks that
the comparison reports it.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from osdpipe.core.compare import diff
from osdpipe.io.loading import without_records
from osdpipe.run.launch import run_local_world
from osdpipe.spec.config import RunSpec
from osdpipe.spec.reconcile import settle_and_validate

#: End to end: it starts worlds, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

#: A spawned world (spawn, every case, every check) must end within this, else it fails.
WORLD_TIMEOUT_S = 240
#: osdpipe's collectives inside a world.
COLLECTIVE_TIMEOUT_S = 120
LR = 0.01
SOURCE_STEPS = 2
RESUME_STEPS = 2
FACTORY = "userlm:build"
UNITS = ["MixerBlock"]

# ---------------------------------------------------------------------------
# Plain PyTorch: building, wrapping and training the user's model (no osdpipe)
# ---------------------------------------------------------------------------


def _new_model() -> nn.Module:
    import userlm

    torch.manual_seed(0)
    return userlm.build()


_MESHES: dict[tuple[int, ...], Any] = {}


def _mesh(shape: tuple[int, ...]) -> Any:
    """A CPU device mesh of ``shape``, made once per world (making one is a collective).

    A 2-D mesh is (replicate, shard); its dimensions are named, as PyTorch's
    state-dict API needs for HSDP.
    """
    from torch.distributed.device_mesh import init_device_mesh

    key = (id(dist.group.WORLD), *shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(
            "cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None
        )
    return _MESHES[key]


def _blocks(model: nn.Module) -> list[nn.Module]:
    import userlm

    return [m for m in model.modules() if isinstance(m, userlm.MixerBlock)]


def _fsdp1(model: nn.Module, use_orig_params: bool = False, hybrid: int | None = None) -> nn.Module:
    import userlm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs: dict[str, Any] = {
        "auto_wrap_policy": ModuleWrapPolicy({userlm.MixerBlock}),
        "use_orig_params": use_orig_params,
        "device_id": torch.device("cpu"),
    }
    if hybrid:
        kwargs.update(
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=_mesh((dist.get_world_size() // hybrid, hybrid)),
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP(model, **kwargs)


def _fsdp2(model: nn.Module, hybrid: int | None = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = _mesh((world // hybrid, hybrid) if hybrid else (world,))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """``steps`` steps of next-token prediction on random token batches (this rank's own batch)."""
    import userlm

    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
        tokens = torch.randint(0, userlm.VOCAB, (2, 6), generator=gen)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, userlm.VOCAB).float(), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
    optim.zero_grad(set_to_none=True)  # PyTorch's state-dict API refuses gradients without optimizer state


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LR)


def _local(value: Any) -> Any:
    """``value`` with every DTensor as its local tensor (recursively)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


def _full_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------
# Sources: one world of 4 ranks trains and saves each
# ---------------------------------------------------------------------------


def _save_sources(root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import osdpipe

    rank = dist.get_rank()
    base = Path(root) / "sources"

    def directory(name: str, *sub: str) -> Path:
        path = base.joinpath(name, *sub)
        path.mkdir(parents=True, exist_ok=True)
        return path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # none: the unwrapped model, one process
        if rank == 0:
            model = _new_model()
            optim = _adam(model)
            _train(model, optim, SOURCE_STEPS, seed=0)
            torch.save(optim.state_dict(), directory("none") / "optim.pt")
            torch.save(_full_optim_state(model, optim), directory("none") / "full.pt")

        # ddp: rank 0 saves its optimizer's state (the same on every rank)
        model = _ddp(_new_model())
        optim = _adam(model)
        _train(model, optim, SOURCE_STEPS, seed=0)
        full = _full_optim_state(model, optim)
        if rank == 0:
            torch.save(optim.state_dict(), directory("ddp") / "optim.pt")
            torch.save(full, directory("ddp") / "full.pt")

        # fsdp1 (FULL_SHARD) and fsdp1_hybrid (HYBRID_SHARD on a 2x2 mesh)
        for name, hybrid in (("fsdp1", None), ("fsdp1_hybrid", 2)):
            model = _fsdp1(_new_model(), hybrid=hybrid)
            optim = _adam(model)
            _train(model, optim, SOURCE_STEPS, seed=0)
            with FSDP.state_dict_type(
                model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig(rank0_only=False)
            ):
                full = FSDP.optim_state_dict(model, optim)
            if rank == 0:
                torch.save(full, directory(name) / "full.pt")
            torch.save(optim.state_dict(), directory(name, "rank_local") / f"rank_{rank}.pt")

        # fsdp2 and fsdp2_hsdp
        for name, hybrid in (("fsdp2", None), ("fsdp2_hsdp", 2)):
            model = _fsdp2(_new_model(), hybrid=hybrid)
            optim = _adam(model)
            _train(model, optim, SOURCE_STEPS, seed=0)
            dcp.save({"optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=str(directory(name, "dcp")))
            torch.save(osdpipe.to_rank_local(optim.state_dict()), directory(name, "rank_local") / f"rank_{rank}.pt")
            full = _full_optim_state(model, optim)
            if rank == 0:
                torch.save(full, directory(name) / "full.pt")
    dist.barrier()


# ---------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    """One saved form of a source job, as osdpipe is told about it."""

    source: str  # the source job (its directory, and its ground truth full.pt)
    format: str
    path: str  # under the source's directory
    layout: dict[str, Any]
    param_groups: list[list[str]] | None = None


@dataclass(frozen=True)
class Target:
    kind: str
    layout: dict[str, Any]
    output: str = "rank_local"

    @property
    def world_size(self) -> int:
        return int(self.layout["world_size"])

    @property
    def hybrid(self) -> int | None:
        return self.layout.get("shard_group_size")


FSDP1_4 = {"kind": "fsdp1", "world_size": 4, "wrap": UNITS}
FSDP2_4 = {"kind": "fsdp2", "world_size": 4, "wrap": UNITS}
HYBRID = {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}

INPUTS: dict[str, Input] = {
    "none": Input("none", "plain", "optim.pt", {"kind": "none", "world_size": 1}, param_groups=[["*"]]),
    "ddp": Input("ddp", "plain", "optim.pt", {"kind": "ddp", "world_size": 4}, param_groups=[["*"]]),
    "fsdp1": Input("fsdp1", "fsdp_full", "full.pt", FSDP1_4),
    "fsdp1_hybrid": Input("fsdp1_hybrid", "rank_local", "rank_local", {**FSDP1_4, **HYBRID}),
    "fsdp2": Input("fsdp2", "dcp", "dcp", FSDP2_4),
    "fsdp2_hsdp": Input("fsdp2_hsdp", "rank_local", "rank_local", {**FSDP2_4, "shard_group_size": 2}),
    # the other saved forms of three sources
    "fsdp1_rank_local": Input("fsdp1", "rank_local", "rank_local", FSDP1_4),
    "fsdp2_hsdp_dcp": Input("fsdp2_hsdp", "dcp", "dcp", {**FSDP2_4, "shard_group_size": 2}),
    # rank 3 holds no row of the 6-row parameters
    "fsdp2_rank_local": Input("fsdp2", "rank_local", "rank_local", FSDP2_4),
}

TARGETS: dict[str, Target] = {
    "none": Target("none", {"kind": "none", "world_size": 1}, output="plain"),
    "ddp": Target("ddp", {"kind": "ddp", "world_size": 2}),
    "fsdp1": Target("fsdp1", {"kind": "fsdp1", "world_size": 2, "wrap": UNITS, "use_orig_params": True}),
    "fsdp1_hybrid": Target("fsdp1", {"kind": "fsdp1", "world_size": 4, "wrap": UNITS, **HYBRID}),
    "fsdp2": Target("fsdp2", {"kind": "fsdp2", "world_size": 2, "wrap": UNITS}),
    "fsdp2_hsdp": Target("fsdp2", {"kind": "fsdp2", "world_size": 4, "wrap": UNITS, "shard_group_size": 2}),
    "fsdp2@dcp": Target("fsdp2", {"kind": "fsdp2", "world_size": 2, "wrap": UNITS}, output="dcp"),
    "fsdp2_hsdp@dcp": Target(
        "fsdp2", {"kind": "fsdp2", "world_size": 4, "wrap": UNITS, "shard_group_size": 2}, output="dcp"
    ),
}


@dataclass(frozen=True)
class Case:
    input: str
    target: str

    @property
    def name(self) -> str:
        return f"{self.input}-to-{self.target}"


MAIN = ("none", "ddp", "fsdp1", "fsdp1_hybrid", "fsdp2", "fsdp2_hsdp")
CASES: list[Case] = [Case(i, t) for i in MAIN for t in MAIN]
CASES += [
    Case("fsdp1_rank_local", "fsdp2"),
    Case("fsdp1_rank_local", "fsdp1_hybrid"),
    Case("fsdp2_hsdp_dcp", "fsdp1"),
    Case("fsdp2_hsdp_dcp", "none"),
    Case("fsdp2_rank_local", "fsdp1"),
    Case("fsdp2_rank_local", "fsdp2_hsdp"),
    Case("fsdp2", "fsdp2@dcp"),
    Case("none", "fsdp2@dcp"),
    Case("fsdp1_hybrid", "fsdp2_hsdp@dcp"),
    Case("fsdp2_hsdp", "fsdp2_hsdp@dcp"),
]
assert len({c.name for c in CASES}) == len(CASES)


def _spec(case: Case, root: Path) -> RunSpec:
    inp, target = INPUTS[case.input], TARGETS[case.target]
    return settle_and_validate(
        {
            "model": {"factory": FACTORY},
            "source": inp.layout,
            "target": target.layout,
            "optim": {"name": "Adam", "lr": LR},
            "input": {
                "path": str(root / "sources" / inp.source / inp.path),
                "format": inp.format,
                "param_groups": inp.param_groups,
            },
            "output": {"path": str(root / "out" / case.name), "format": target.output},
            "runtime": {"timeout_s": COLLECTIVE_TIMEOUT_S, "progress": False},
        }
    )


# ---------------------------------------------------------------------------
# PyTorch's word on a target rank
# ---------------------------------------------------------------------------


_JOBS: dict[tuple[int, str], tuple[nn.Module, nn.Module]] = {}


def _target_job(target: Target) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(the model as trained, the unwrapped module, a fresh optimizer) for ``target``, by plain PyTorch code.

    The wrapped model is made once per world and layout (what PyTorch converts
    depends on its structure, not on its weights); the optimizer is new each time.
    """
    key = (id(dist.group.WORLD), repr(sorted(target.layout.items())))
    if key not in _JOBS:
        raw = _new_model()
        if target.kind == "none":
            model = raw
        elif target.kind == "ddp":
            model = _ddp(raw)
        elif target.kind == "fsdp1":
            model = _fsdp1(raw, use_orig_params=bool(target.layout.get("use_orig_params")), hybrid=target.hybrid)
        else:
            model = _fsdp2(raw, hybrid=target.hybrid)
        _JOBS[key] = (model, raw)
    model, raw = _JOBS[key]
    return model, raw, _adam(model)


def _expected(
    target: Target, model: nn.Module, raw: nn.Module, optim: torch.optim.Optimizer, full: dict[str, Any]
) -> dict[str, Any]:
    """What PyTorch says this rank's optimizer loads, from the ground truth ``full``.

    For FSDP2 the optimizer is left holding it (``set_optimizer_state_dict``),
    and the result is its ``state_dict()`` with DTensors (see :func:`_local`).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    full = copy.deepcopy(full)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if target.kind == "fsdp1":
            return FSDP.optim_state_dict_to_load(model, optim, full)
        if target.kind in ("none", "ddp"):
            return FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, raw, optim=optim)
        set_optimizer_state_dict(model, optim, full, options=StateDictOptions(full_state_dict=True))
        return optim.state_dict()


def _dtensor_table(optim: torch.optim.Optimizer, expected: dict[str, Any]) -> dict[int, dict[str, list[Any]]]:
    """Per param ID with DTensor state: its parameter's global shape, mesh shape and placements,
    read off the live parameter."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optim.param_groups for p in g["params"]]
    table = {}
    for pid, state in expected["state"].items():
        if any(isinstance(v, DTensor) for v in state.values()):
            p = params[pid]
            table[pid] = {
                "shape": list(p.shape), "mesh": list(p.device_mesh.shape), "placements": [str(x) for x in p.placements]
            }
    return table


def _compare(target: Target, got: dict[str, Any], expected: dict[str, Any], optim: torch.optim.Optimizer) -> list[str]:
    """Where the converted file ``got`` and PyTorch's ``expected`` differ (empty: equal)."""
    if target.kind != "fsdp2":
        return diff(without_records(got), expected, path="output")
    rest = without_records(got)
    problems = diff(rest, _local(expected), path="output", sequence_types=False)
    # The mesh's names are recorded for people, not compared (osdpipe.layout.ranges.same_placement):
    # this job's 1-D mesh has none.
    table = {
        pid: {k: v for k, v in entry.items() if k != "mesh_dim_names"}
        for pid, entry in (got.get("dtensor") or {}).items()
    }
    problems += diff(table, _dtensor_table(optim, expected), path="output['dtensor']")
    return problems


def _nonfinite(optim: torch.optim.Optimizer) -> list[str]:
    out = []
    for pid, state in enumerate(optim.state.values()):
        for name, value in state.items():
            value = _local(value)
            if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                out.append(f"state {pid}.{name} is not finite after {RESUME_STEPS} steps")
    return out


def _check_file(case: Case, root: Path) -> list[str]:
    """On this rank of a target world: the output file against PyTorch, then load it and train on."""
    import osdpipe

    target = TARGETS[case.target]
    out = root / "out" / case.name
    path = out / ("optim.pt" if target.output == "plain" else f"rank_{dist.get_rank()}.pt")
    if not path.is_file():
        return [f"{path.name} was not written"]
    full = torch.load(root / "sources" / INPUTS[case.input].source / "full.pt", weights_only=True)
    model, raw, optim = _target_job(target)
    expected = _expected(target, model, raw, optim, full)
    got = torch.load(path, weights_only=True)
    problems = _compare(target, got, expected, optim)
    if not expected["state"]:
        problems.append("PyTorch gives this rank no state at all: nothing was compared")

    optim.state.clear()  # whatever the optimizer holds now comes from the file
    if target.output == "plain":
        optim.load_state_dict(got)
    else:
        osdpipe.load_rank_local(optim, path)
    problems += [
        f"after loading: {p}"
        for p in diff(_local(optim.state_dict()), _local(expected), path="optim", sequence_types=False)
    ]
    _train(model, optim, RESUME_STEPS, seed=7)
    return problems + _nonfinite(optim)


def _check_dcp(case: Case, root: Path) -> list[str]:
    """On this rank of an FSDP2 target world: load the DCP output as PyTorch does,
    and hold the full state against the ground truth."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    target = TARGETS[case.target]
    directory = root / "out" / case.name / "dcp"
    if not (directory / ".metadata").is_file():
        return [f"{directory} holds no DCP checkpoint"]
    full = torch.load(root / "sources" / INPUTS[case.input].source / "full.pt", weights_only=True)
    model, _, optim = _target_job(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = {"optim": get_optimizer_state_dict(model, optim)}
        dcp.load(sd, checkpoint_id=str(directory))
        set_optimizer_state_dict(model, optim, sd["optim"])
    loaded = _full_optim_state(model, optim)
    problems = diff(loaded, full, path="full", sequence_types=False)
    if len(loaded["state"]) != len(list(model.parameters())):
        problems.append(
            f"the loaded state covers {len(loaded['state'])} parameters, the model has {len(list(model.parameters()))}"
        )
    _train(model, optim, RESUME_STEPS, seed=7)
    return problems + _nonfinite(optim)


def _sensitivity(case: Case, root: Path) -> list[str]:
    """The comparison of :func:`_check_file` with one element of one converted tensor flipped: it must report it."""
    target = TARGETS[case.target]
    path = root / "out" / case.name / ("optim.pt" if target.output == "plain" else f"rank_{dist.get_rank()}.pt")
    full = torch.load(root / "sources" / INPUTS[case.input].source / "full.pt", weights_only=True)
    model, raw, optim = _target_job(target)
    expected = _expected(target, model, raw, optim, full)
    got = torch.load(path, weights_only=True)
    if _compare(target, got, expected, optim):
        return ["the untouched file already differs"]
    key = next(k for k, s in got["state"].items() if s["exp_avg"].numel() > 0)
    flat = got["state"][key]["exp_avg"].view(-1)
    i = flat.numel() // 2
    flat[i] = torch.nextafter(flat[i], torch.tensor(math.inf))
    problems = _compare(target, got, expected, optim)
    if not any(f"[{key!r}]['exp_avg']" in p and "1 element(s) differ" in p for p in problems):
        return [f"one flipped element of state {key!r} exp_avg went unnoticed: {problems}"]
    return []


# ---------------------------------------------------------------------------
# The worlds
# ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """One case: osdpipe's report (rank 0's) and, per target rank, where PyTorch and the output disagree."""

    ok: bool = False
    error: str | None = None
    failed_checks: list[str] = field(default_factory=list)
    problems: list[list[str]] = field(default_factory=list)


def _convert_and_check(cases: list[tuple[Case, RunSpec]], root: str, sensitivity: list[Case]) -> dict[str, Outcome]:
    """On every rank of one target world: convert every case with osdpipe, then check every case against PyTorch."""
    from osdpipe.pipeline.execute import run_rank
    from osdpipe.run.collective import StageError
    from osdpipe.spec.plan import plan_run

    results: dict[str, Outcome] = {}
    for case, spec in cases:
        try:
            report = run_rank(plan_run(spec))
            results[case.name] = Outcome(
                ok=report.ok, failed_checks=[f"{c.name}: {c.detail}" for c in report.checks if not c.ok]
            )
        except StageError as exc:  # raised alike on every rank: the world stays in step
            results[case.name] = Outcome(error=str(exc))
    for case, _ in cases:
        check = _check_dcp if TARGETS[case.target].output == "dcp" else _check_file
        try:
            results[case.name].problems = [check(case, Path(root))]
        except Exception as exc:  # noqa: BLE001 - one case's failure must not hide the others'
            results[case.name].problems = [[f"{type(exc).__name__}: {exc}"]]
    for case in sensitivity:
        try:
            results[f"<sensitivity {case.name}>"] = Outcome(ok=True, problems=[_sensitivity(case, Path(root))])
        except Exception as exc:  # noqa: BLE001
            results[f"<sensitivity {case.name}>"] = Outcome(problems=[[f"{type(exc).__name__}: {exc}"]])
    return results


#: Whose comparison the sensitivity test tampers with: one target of each comparison path.
SENSITIVITY = [
    Case("fsdp2_hsdp", "fsdp1"),
    Case("fsdp1", "fsdp2"),
    Case("fsdp1_hybrid", "ddp"),
    Case("fsdp2", "none"),
    Case("ddp", "fsdp2_hsdp"),
]


def _merge(per_rank: list[dict[str, Outcome]]) -> dict[str, Outcome]:
    merged = {}
    for name, outcome in per_rank[0].items():
        outcome.problems = [r[name].problems[0] for r in per_rank]
        merged[name] = outcome
    return merged


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    root = tmp_path_factory.mktemp("kinds_matrix")
    by_world: dict[int, list[Case]] = {}
    for case in CASES:
        by_world.setdefault(TARGETS[case.target].world_size, []).append(case)
    sensitivity = {w: [c for c in SENSITIVITY if TARGETS[c.target].world_size == w] for w in by_world}
    results: dict[str, Outcome] = {}
    # The source world is also the world of the 4-rank targets (their specs are validated there, once the inputs exist).
    ran = run_local_world(
        _sources_then_convert, 4, (str(root), by_world[4], sensitivity[4]), timeout_s=WORLD_TIMEOUT_S
    )
    results.update(_merge(ran))
    for world in sorted(w for w in by_world if w != 4):
        jobs = [(c, _spec(c, root)) for c in by_world[world]]
        ran = run_local_world(
            _convert_and_check, world, (jobs, str(root), sensitivity[world]), timeout_s=WORLD_TIMEOUT_S
        )
        results.update(_merge(ran))
    return results


def _sources_then_convert(root: str, cases: list[Case], sensitivity: list[Case]) -> dict[str, Outcome]:
    """Save the sources, then validate the specs (their inputs must exist) and convert and check on this world."""
    _save_sources(root)
    return _convert_and_check([(c, _spec(c, Path(root))) for c in cases], root, sensitivity)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_conversion_matches_pytorch(case: Case, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[case.name]
    assert outcome.ok, f"osdpipe failed: {outcome.error or outcome.failed_checks}"
    target = TARGETS[case.target]
    assert len(outcome.problems) == target.world_size, "the PyTorch check did not run on every target rank"
    for rank, problems in enumerate(outcome.problems):
        assert not problems, f"rank {rank}: " + "; ".join(problems[:8])


@pytest.mark.parametrize("case", SENSITIVITY, ids=[c.name for c in SENSITIVITY])
def test_comparison_sees_one_flipped_element(case: Case, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[f"<sensitivity {case.name}>"]
    for rank, problems in enumerate(outcome.problems):
        assert not problems, f"rank {rank}: {problems}"


def test_matrix_covers_every_kind_both_ways() -> None:
    kinds = {"none", "ddp", "fsdp1", "fsdp2"}
    assert {INPUTS[c.input].layout["kind"] for c in CASES} == kinds
    assert {TARGETS[c.target].kind for c in CASES} == kinds
    assert sum(1 for c in CASES if c.input in MAIN and c.target in MAIN) == 36
    assert sum(1 for c in CASES if TARGETS[c.target].output == "dcp") >= 2
