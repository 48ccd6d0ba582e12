"""The scenario matrix of PyTorch's own FSDP1 optimizer-state tests, on CPU/gloo.

Each case builds its source checkpoint with plain PyTorch FSDP1 code (no
osdpipe: ``FullyShardedDataParallel``, ``ModuleWrapPolicy``, a few training
steps, ``FSDP.optim_state_dict`` saved with ``torch.save`` or DCP), converts it
with :func:`osdpipe.pipeline.execute.execute`, and then holds every target rank file,
independently of osdpipe's own verify, against PyTorch on the target layout
(again plain FSDP1 code):

* bitwise against ``FSDP.optim_state_dict_to_load`` from the full state, and
  against PyTorch's older API for the same path where it has one:
  ``FSDP.shard_full_optim_state_dict`` and ``FSDP.scatter_full_optim_state_dict``
  (full input), ``FSDP.flatten_sharded_optim_state_dict`` (DCP input);
  :func:`osdpipe.core.compare.diff` reports one differing element, key or
  param-group field;
* the target optimizer loads it, holds exactly it, and takes steps with
  finite state.

Error cases check osdpipe's message, and that PyTorch refuses the same input.

To stay fast, worlds are shared: one world per source world size builds every
source, and one world per target world size converts and checks every case
with that target. Inside it, a conversion is :func:`osdpipe.pipeline.execute.run_rank`,
which is what :func:`~osdpipe.pipeline.execute.execute` runs on each rank it spawns;
the cases in :data:`VIA_EXECUTE` go through ``execute`` itself (a world each).
"""

from __future__ import annotations

import copy
import fnmatch
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import testmodels
import torch
import torch.distributed as dist
from torch import nn

from osdpipe.core.compare import diff
from osdpipe.io.loading import without_records
from osdpipe.layout.models import NestedModel, TransformerModel
from osdpipe.pipeline.execute import execute
from osdpipe.run.launch import run_local_world
from osdpipe.spec.plan import plan_run
from osdpipe.spec.reconcile import settle_and_validate

#: End to end: it starts worlds, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

TIMEOUT_S = 240

# ---------------------------------------------------------------------------
# Plain PyTorch FSDP1: how a user builds, trains and saves (no osdpipe code)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    world_size: int
    wrap: tuple[str, ...] = ("Block",)
    use_orig_params: bool = False
    sharding_strategy: str = "FULL_SHARD"
    wrap_root: bool = True

    def config(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "wrap": list(self.wrap),
            "use_orig_params": self.use_orig_params,
            "sharding_strategy": self.sharding_strategy,
            "wrap_root": self.wrap_root,
        }


@dataclass(frozen=True)
class Optim:
    name: str = "Adam"
    lr: float = 0.01
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: (FQN patterns, this group's options) per group; empty: one group over model.parameters()
    groups: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = ()

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "lr": self.lr,
            "kwargs": dict(self.kwargs),
            "param_groups": [{"params": list(patterns), **options} for patterns, options in self.groups],
        }


def _new_model(factory: str) -> nn.Module:
    torch.manual_seed(0)
    if factory == "nested":
        return NestedModel()
    if factory == "transformer":
        return TransformerModel()
    return getattr(testmodels, factory.partition(":")[2])()


def _fsdp(factory: str, layout: Layout) -> tuple[nn.Module, nn.Module]:
    """The model wrapped with FSDP1 as ``layout`` says, and the unwrapped module (for the shape of its input)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    raw = _new_model(factory)
    classes = {type(m) for m in raw.modules() if type(m).__name__ in layout.wrap}
    kwargs = {
        "auto_wrap_policy": ModuleWrapPolicy(classes),
        "use_orig_params": layout.use_orig_params,
        "sharding_strategy": ShardingStrategy[layout.sharding_strategy],
        "device_id": torch.device("cpu"),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if layout.wrap_root:
            return FSDP(raw, **kwargs), raw
        for name, module in list(raw.named_children()):  # top-level units only; the root stays plain
            if type(module) in classes:
                setattr(raw, name, FSDP(module, **kwargs))
        return raw, raw


def _optimizer(model: nn.Module, spec: Optim) -> torch.optim.Optimizer:
    """The optimizer, with param groups picked by FQN patterns (a flat parameter by any of its FQNs), in pattern
    order."""
    from torch.distributed.fsdp._optim_utils import _get_param_to_fqns

    params = list(model.parameters())
    if not spec.groups:
        return getattr(torch.optim, spec.name)(params, lr=spec.lr, **spec.kwargs)
    fqns = _get_param_to_fqns(model)
    groups = []
    for patterns, options in spec.groups:
        chosen: list[nn.Parameter] = []
        for pattern in patterns:
            chosen += [
                p
                for p in params
                if all(p is not c for c in chosen) and any(fnmatch.fnmatchcase(f, pattern) for f in fqns[p])
            ]
        groups.append({"params": chosen, **options})
    return getattr(torch.optim, spec.name)(groups, lr=spec.lr, **spec.kwargs)


def _batch(raw: nn.Module, generator: torch.Generator) -> torch.Tensor:
    """A batch of 4 for these models: token IDs for the transformer, vectors for the nested ones."""
    if isinstance(raw, TransformerModel):
        return torch.randint(0, raw.vocab, (4, raw.seq), generator=generator)
    return torch.randn(4, raw.dim, generator=generator)


def _train(model: nn.Module, raw: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    for step in range(steps):
        batch = _batch(raw, torch.Generator().manual_seed(seed * 1000 + step))
        optim.zero_grad(set_to_none=True)
        model(batch).float().pow(2).mean().backward()
        optim.step()


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------

BLOCK2 = Layout(2, ("Block",))


@dataclass(frozen=True)
class Source:
    """One trained source job; ``save`` says which forms of its optimizer state are written."""

    model: str = "nested"
    layout: Layout = BLOCK2
    optim: Optim = Optim()
    steps: int = 3
    odd_state: bool = False  # a float and a None in every parameter's state
    save: tuple[str, ...] = ("full",)  # full (every rank holds it), full_rank0 (rank0_only=True), dcp (SHARDED)


# block1's flat parameter in no group
GROUPS_FLAT = Optim(groups=((("block2.*",), {"weight_decay": 0.1}), (("embed.*",), {})))
# With use_orig_params=True, FSDP.optim_state_dict refuses a unit whose trainable
# parameters are only partly in the optimizer, so here a whole unit (block1) is in no group.
GROUPS_ORIG = Optim(
    groups=((("block2.leaf2.*", "head.*"), {"weight_decay": 0.1}), (("embed.*", "block2.gate", "block2.leaf1.*"), {}))
)

SOURCES: dict[str, Source] = {
    "block": Source(save=("full", "full_rank0", "dcp")),
    "leaf": Source(layout=Layout(2, ("Leaf",))),
    "block_leaf": Source(layout=Layout(2, ("Block", "Leaf"))),
    "transformer": Source(model="transformer", layout=Layout(2, ("TransformerBlock",))),
    "groups_flat": Source(optim=GROUPS_FLAT),
    "groups_orig": Source(layout=Layout(2, ("Block",), use_orig_params=True), optim=GROUPS_ORIG),
    "odd_state": Source(odd_state=True),
    "sgd": Source(optim=Optim(name="SGD")),  # no momentum: no state at all
    "no_step": Source(steps=0),
    "no_shard": Source(layout=Layout(2, ("Block",), sharding_strategy="NO_SHARD")),
    "orig": Source(layout=Layout(2, ("Block",), use_orig_params=True), save=("full", "dcp")),
    "frozen": Source(model="testmodels:make_frozen", layout=Layout(2, ("Block",), use_orig_params=True)),
    "unmanaged": Source(model="testmodels:make_unmanaged", layout=Layout(2, ("Block",), wrap_root=False)),
    "block4": Source(layout=Layout(4, ("Block",))),
}


def _save_sources(names: list[str], root: str) -> None:
    """On every rank of the source world: train each source and save its optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank = dist.get_rank()
    for name in names:
        src = SOURCES[name]
        out = Path(root) / name
        model, raw = _fsdp(src.model, src.layout)
        optim = _optimizer(model, src.optim)
        _train(model, raw, optim, src.steps)
        if src.odd_state:
            for state in optim.state.values():
                state["lr_scale"] = 0.5
                state["note"] = None
        # With use_orig_params=True on CPU, offload_to_cpu=True (the default) makes
        # FSDP.optim_state_dict return every tensor state of a unit as a view of one
        # all-gather buffer that is reused per state name (.cpu() of a CPU tensor is
        # the tensor itself; see _allgather_orig_param_states and
        # _unflatten_orig_param_states in torch/distributed/fsdp/_optim_utils.py), so
        # exp_avg comes back equal to exp_avg_sq. offload_to_cpu=False clones instead.
        offload = not src.layout.use_orig_params
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if "full" in src.save:
                cfg = FullOptimStateDictConfig(rank0_only=False, offload_to_cpu=offload)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), cfg):
                    full = FSDP.optim_state_dict(model, optim)
                if rank == dist.get_world_size() - 1:  # every rank holds it; any one may save it
                    out.mkdir(parents=True, exist_ok=True)
                    torch.save(full, out / "full.pt")
            if "full_rank0" in src.save:
                cfg = FullOptimStateDictConfig(rank0_only=True, offload_to_cpu=offload)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), cfg):
                    full = FSDP.optim_state_dict(model, optim)
                if rank == 0:
                    out.mkdir(parents=True, exist_ok=True)
                    torch.save(full, out / "full_rank0.pt")
                else:
                    assert full == {}, "rank0_only=True: only rank 0 holds the state"
            if "dcp" in src.save:
                with FSDP.state_dict_type(
                    model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
                ):
                    sharded = FSDP.optim_state_dict(model, optim)
                dcp.save({"optim": sharded}, checkpoint_id=str(out / "dcp"))
    dist.barrier()


def _derive_sources(root: Path) -> None:
    """Odd inputs made from the saved full state of source ``block``, as a user's edited checkpoint would be."""
    full = torch.load(root / "block" / "full.pt", weights_only=True)
    (root / "derived").mkdir()

    no_groups = copy.deepcopy(full)
    del no_groups["param_groups"]
    torch.save(no_groups, root / "derived" / "no_param_groups.pt")

    # A parameter of FSDP unit block1 without state. Training cannot make one
    # with FSDP1: the flat parameter's gradient covers every parameter of the
    # unit, so even a parameter outside the forward gets (zero) state.
    missing = copy.deepcopy(full)
    del missing["state"]["block1.leaf1.scale"]
    torch.save(missing, root / "derived" / "missing_state.pt")

    other_step = copy.deepcopy(full)
    other_step["state"]["block1.gate"]["step"] = other_step["state"]["block1.gate"]["step"] + 1
    torch.save(other_step, root / "derived" / "differing_step.pt")

    extra_name = copy.deepcopy(full)
    extra_name["state"]["block1.gate"]["extra"] = torch.zeros_like(extra_name["state"]["block1.gate"]["exp_avg"])
    torch.save(extra_name, root / "derived" / "extra_state_name.pt")


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

FULL_APIS = ("optim_state_dict_to_load", "shard_full_optim_state_dict", "scatter_full_optim_state_dict")
DCP_APIS = ("optim_state_dict_to_load", "flatten_sharded_optim_state_dict")


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    target: Layout
    input: str = "full.pt"  # under the source's directory; "derived/<file>" for the edited ones
    apis: tuple[str, ...] = FULL_APIS
    error: tuple[str, ...] = ()  # osdpipe must fail with a message holding all of these
    pytorch_error: str = ""  # ... and PyTorch must refuse the input with this
    odd_state: bool = False

    def input_path(self, root: Path) -> Path:
        return root / self.input if self.input.startswith("derived/") else root / self.source / self.input

    def reference_path(self, root: Path) -> Path:
        """The full state PyTorch converts for comparison (the DCP input's twin, saved from the same optimizer)."""
        return root / self.source / "full.pt" if self.input == "dcp" else self.input_path(root)


CASES = [
    # nested units: [Block] -> [Leaf], [Leaf] -> [Block], [Block] -> [Block, Leaf] (3 levels), [Block, Leaf] -> [Leaf]
    Case("nested_block_to_leaf", "block", Layout(2, ("Leaf",))),
    Case("nested_leaf_to_block", "leaf", Layout(2, ("Block",))),
    Case("nested_block_to_block_leaf_ws3", "block", Layout(3, ("Block", "Leaf"))),
    Case("nested_block_leaf_to_leaf", "block_leaf", Layout(2, ("Leaf",))),
    # the tied embedding / output head
    Case("transformer_tied_ws3", "transformer", Layout(3, ("TransformerBlock",))),
    Case("transformer_tied_to_orig_params", "transformer", Layout(2, ("TransformerBlock",), use_orig_params=True)),
    # world sizes: doubled, halved, and 3, which divides neither Block unit
    # (488 elements each; 2 and 4 do not divide the root's 99)
    Case("world_doubled_2_to_4", "block", Layout(4, ("Block",))),
    Case("world_halved_4_to_2", "block4", Layout(2, ("Block",))),
    Case("world_2_to_3", "block", Layout(3, ("Block",))),
    # param groups: out of model order, one with its own weight_decay, a parameter in none
    Case("groups_flat_params_ws3", "groups_flat", Layout(3, ("Block",))),
    Case("groups_orig_params_rewrapped", "groups_orig", Layout(3, ("Block", "Leaf"), use_orig_params=True)),
    # state-dict types: rank0_only FULL, SHARDED through DCP
    Case("full_rank0_only", "block", Layout(3, ("Leaf",)), input="full_rank0.pt"),
    Case("sharded_dcp", "block", Layout(3, ("Leaf",)), input="dcp", apis=DCP_APIS),
    Case("sharded_dcp_orig_params", "orig", Layout(2, ("Leaf",), use_orig_params=True), input="dcp", apis=DCP_APIS),
    # unmanaged parameters: the root's own parameters stay whole outside FSDP
    Case("unmanaged_stays_unmanaged", "unmanaged", Layout(3, ("Block",), wrap_root=False)),
    Case("unmanaged_to_wrapped_root", "unmanaged", Layout(2, ("Block",))),
    # odd state
    # (FSDP.scatter_full_optim_state_dict cannot take a float state: with rank0_only it
    # calls .cpu() on every state value of rank 0, see _flatten_optim_state_dict.)
    Case("non_tensor_state", "odd_state", Layout(3, ("Leaf",)), apis=FULL_APIS[:2], odd_state=True),
    Case(
        "non_tensor_state_orig_params",
        "odd_state",
        Layout(2, ("Leaf",), use_orig_params=True),
        apis=FULL_APIS[:2],
        odd_state=True,
    ),
    Case("sgd_no_momentum", "sgd", Layout(3, ("Leaf",))),
    Case("no_step_empty_state", "no_step", Layout(3, ("Leaf",))),
    Case("no_param_groups", "block", Layout(2, ("Leaf",)), input="derived/no_param_groups.pt"),
    # strategies and use_orig_params on both sides
    Case("no_shard_both_sides", "no_shard", Layout(3, ("Block", "Leaf"), sharding_strategy="NO_SHARD")),
    Case("orig_params_both_sides", "orig", Layout(3, ("Leaf",), use_orig_params=True)),
    Case("frozen_param_orig_params", "frozen", Layout(3, ("Leaf",), use_orig_params=True)),
    # errors
    Case(
        "error_param_without_state",
        "block",
        Layout(2, ("Block",)),
        input="derived/missing_state.pt",
        error=("must have the same scalar state", "block1.leaf1.scale"),
        pytorch_error="must have scalar state with the same value and dtype",
    ),
    # ... which is an error only where the parameters share a flat parameter
    Case(
        "param_without_state_to_orig_params",
        "block",
        Layout(2, ("Block",), use_orig_params=True),
        input="derived/missing_state.pt",
    ),
    Case(
        "error_differing_step",
        "block",
        Layout(2, ("Block",)),
        input="derived/differing_step.pt",
        error=("must have the same scalar state 'step'", "block1.gate"),
        pytorch_error="must have scalar state with the same value and dtype",
    ),
    Case(
        "error_differing_state_names",
        "block",
        Layout(2, ("Block",)),
        input="derived/extra_state_name.pt",
        error=("differing optimizer state names", "block1.gate"),
        pytorch_error="Differing optimizer state names",
    ),
]
assert len({c.name for c in CASES}) == len(CASES)


def _spec(case: Case, root: Path):
    src = SOURCES[case.source]
    return settle_and_validate(
        {
            "model": {"factory": src.model},
            "source": src.layout.config(),
            "target": case.target.config(),
            "optim": src.optim.config(),
            "input": {
                "path": str(case.input_path(root)),
                "format": "dcp" if case.input == "dcp" else "fsdp_full",
                "key": "optim",
            },
            "output": {"path": str(root / "out" / case.name)},
            "runtime": {"timeout_s": TIMEOUT_S, "progress": False},
        }
    )


# ---------------------------------------------------------------------------
# PyTorch's word on the target world
# ---------------------------------------------------------------------------


def _pytorch(
    api: str, model: nn.Module, optim: torch.optim.Optimizer, full: dict[str, Any], dcp_dir: Path | None
) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = copy.deepcopy(full)  # some APIs edit their input in place
        if api == "optim_state_dict_to_load":
            return FSDP.optim_state_dict_to_load(model, optim, full)
        if api == "shard_full_optim_state_dict":
            return FSDP.shard_full_optim_state_dict(full, model, optim=optim)
        if api == "scatter_full_optim_state_dict":
            return FSDP.scatter_full_optim_state_dict(full if dist.get_rank() == 0 else None, model, optim=optim)
        if api == "flatten_sharded_optim_state_dict":
            # PyTorch's own way to read FSDP1's SHARDED optimizer state back onto
            # another world: the model's sharded state dict gives the layout.
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.optimizer import (
                load_sharded_optimizer_state_dict,
            )
            from torch.distributed.fsdp import (
                ShardedOptimStateDictConfig,
                ShardedStateDictConfig,
                StateDictType,
            )

            assert dcp_dir is not None
            with FSDP.state_dict_type(
                model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
            ):
                sharded = load_sharded_optimizer_state_dict(
                    model.state_dict(), "optim", dcp.FileSystemReader(str(dcp_dir))
                )["optim"]
                return FSDP.flatten_sharded_optim_state_dict(sharded, model, optim)
    raise ValueError(api)


def _check_case(case: Case, root: Path) -> list[str]:
    """On this rank of the target world: every way PyTorch has of saying what this rank loads,
    against osdpipe's file."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    src = SOURCES[case.source]
    rank = dist.get_rank()
    model, raw = _fsdp(src.model, case.target)
    optim = _optimizer(model, src.optim)
    full = torch.load(case.reference_path(root), weights_only=True)
    if case.error:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                FSDP.optim_state_dict_to_load(model, optim, full)
        except ValueError as exc:
            return [] if case.pytorch_error in str(exc) else [f"PyTorch refused it with another message: {exc}"]
        return ["PyTorch converts this input, but osdpipe is expected to refuse it"]

    problems = []
    got = without_records(torch.load(root / "out" / case.name / f"rank_{rank}.pt", weights_only=True))
    for api in case.apis:
        expected = _pytorch(api, model, optim, full, root / case.source / "dcp" if case.input == "dcp" else None)
        problems += [f"vs FSDP.{api}: {p}" for p in diff(got, expected, path="rank_file")]
    if case.source == "unmanaged" and not case.target.wrap_root:
        from torch.distributed.fsdp._optim_utils import _get_param_to_fqns

        fqns = _get_param_to_fqns(model)
        pid = next(i for i, p in enumerate(model.parameters()) if fqns[p] == ["temperature"])
        if tuple(got["state"][pid]["exp_avg"].shape) != (3,):
            problems.append(
                f"the unmanaged parameter's state is not whole on rank {rank}:"
                f" {tuple(got['state'][pid]['exp_avg'].shape)}"
            )
    if case.odd_state:
        odd = [
            k
            for k, s in got["state"].items()
            if s.get("lr_scale") != 0.5
            or type(s.get("lr_scale")) is not float
            or "note" not in s
            or s["note"] is not None
        ]
        if odd or not got["state"]:
            problems.append(f"non-tensor state lost for keys {odd}")

    # The target optimizer loads it, then holds exactly it, then trains on with finite state.
    loadable = copy.deepcopy(got)
    if "param_groups" not in loadable:  # the user supplies the groups the file lacks: the optimizer's own
        loadable["param_groups"] = optim.state_dict()["param_groups"]
    optim.load_state_dict(loadable)
    problems += [
        f"after load_state_dict: {p}" for p in diff(optim.state_dict()["state"], got["state"], path="optim.state")
    ]
    _train(model, raw, optim, steps=2, seed=7)
    for key, state in optim.state_dict()["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                problems.append(f"state {key}.{name} is not finite after two steps")
    return problems


def _sensitivity(root: Path) -> list[str]:
    """The comparison itself: one changed element, key or param-group field must each show."""
    case = next(c for c in CASES if c.name == "nested_block_to_leaf")
    src = SOURCES[case.source]
    model, _ = _fsdp(src.model, case.target)
    optim = _optimizer(model, src.optim)
    expected = _pytorch(
        "optim_state_dict_to_load", model, optim, torch.load(case.reference_path(root), weights_only=True), None
    )
    got = without_records(torch.load(root / "out" / case.name / f"rank_{dist.get_rank()}.pt", weights_only=True))
    key = max(got["state"])
    tampered: dict[str, dict[str, Any]] = {
        name: copy.deepcopy(got) for name in ("element", "step", "key", "state_name", "group_field", "group_params")
    }
    flat = tampered["element"]["state"][key]["exp_avg"].view(-1)
    flat[flat.numel() // 2] = torch.nextafter(flat[flat.numel() // 2], torch.tensor(math.inf))
    tampered["step"]["state"][key]["step"] += 1
    del tampered["key"]["state"][key]
    del tampered["state_name"]["state"][key]["exp_avg_sq"]
    tampered["group_field"]["param_groups"][0]["eps"] = 1.0000001e-8
    tampered["group_params"]["param_groups"][0]["params"] = tampered["group_params"]["param_groups"][0]["params"][:-1]
    missed = [name for name, osd in tampered.items() if not diff(osd, expected)]
    return (
        ([] if not diff(got, expected) else ["the untampered file differs"])
        + [f"a changed {name} went unnoticed" for name in missed]
    )


@dataclass
class Outcome:
    """What became of one case: osdpipe's side (from rank 0), and PyTorch's check on every target rank."""

    ok: bool = False
    error: str | None = None  # osdpipe's error, if it refused
    failed_checks: list[str] = field(default_factory=list)  # osdpipe's own verify checks that failed
    warnings: list[str] = field(default_factory=list)  # the report's warnings (rank 0's)
    pytorch: list[list[str]] = field(default_factory=list)  # per target rank: where the file and PyTorch disagree
    files: list[str] = field(default_factory=list)  # the rank files written


def _convert(spec) -> Outcome:
    """osdpipe's conversion on this rank: what :func:`osdpipe.pipeline.execute.execute` runs on each spawned rank."""
    from osdpipe.pipeline.execute import run_rank
    from osdpipe.run.collective import StageError

    try:
        report = run_rank(plan_run(spec))
    except StageError as exc:  # raised alike on every rank: the world stays in step
        return Outcome(error=str(exc))
    return Outcome(
        ok=report.ok,
        failed_checks=[f"{c.name}: {c.detail}" for c in report.checks if not c.ok],
        warnings=report.warnings,
    )


def _convert_and_check_world(jobs: list[tuple[Case, Any]], root: str, sensitivity: bool) -> dict[str, Outcome]:
    """On every rank of one target world: convert each case (unless ``execute`` already did), then check it."""
    results = {}
    for case, spec in jobs:
        outcome = _convert(spec) if spec is not None else Outcome()
        try:
            outcome.pytorch = [_check_case(case, Path(root))]
        except Exception as exc:  # noqa: BLE001 - one case's failure must not hide the others'
            outcome.pytorch = [[f"{type(exc).__name__}: {exc}"]]
        results[case.name] = outcome
    if sensitivity:
        results["<sensitivity>"] = Outcome(ok=True, pytorch=[_sensitivity(Path(root))])
    return results


def _save_sources_then_convert(names: list[str], jobs: list[tuple[Case, Any]], root: str) -> dict[str, Outcome]:
    _save_sources(names, root)
    return _convert_and_check_world(jobs, root, sensitivity=False)


# ---------------------------------------------------------------------------
# The run: sources once, conversions, one check world per target world size
# ---------------------------------------------------------------------------

#: Converted through :func:`osdpipe.pipeline.execute.execute` (a world of its own each, as
#: the CLI does); the others run the same per-rank pipeline inside a shared world.
VIA_EXECUTE = ("sharded_dcp", "error_param_without_state")


def _merge(results: dict[str, Outcome], per_rank: list[dict[str, Outcome]]) -> None:
    for name, outcome in per_rank[0].items():
        outcome.pytorch = [r[name].pytorch[0] for r in per_rank]
        if name in results:  # converted by execute: keep its report, add PyTorch's word
            results[name].pytorch = outcome.pytorch
        else:
            results[name] = outcome


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    root = tmp_path_factory.mktemp("scenarios")
    specs = {}

    def jobs(world: int) -> list[tuple[Case, Any]]:
        return [
            (c, None if c.name in VIA_EXECUTE else specs.setdefault(c.name, _spec(c, root)))
            for c in CASES
            if c.target.world_size == world
        ]

    # Sources of 2 ranks; then the world of 4 saves its source and takes the 2 -> 4 conversions.
    sources = {w: [n for n, s in SOURCES.items() if s.layout.world_size == w] for w in (2, 4)}
    assert sorted(sources[2] + sources[4]) == sorted(SOURCES), "sources need a world of 2 or 4 ranks"
    run_local_world(_save_sources, 2, (sources[2], str(root)), timeout_s=TIMEOUT_S)
    _derive_sources(root)
    results: dict[str, Outcome] = {}
    _merge(
        results, run_local_world(_save_sources_then_convert, 4, (sources[4], jobs(4), str(root)), timeout_s=TIMEOUT_S)
    )
    for case in CASES:
        if case.name in VIA_EXECUTE:
            report = execute(plan_run(_spec(case, root)))
            results[case.name] = Outcome(
                ok=report.ok,
                error=report.error,
                failed_checks=[f"{c.name}: {c.detail}" for c in report.checks if not c.ok],
            )
    for world in sorted({c.target.world_size for c in CASES} - {4}):
        _merge(
            results,
            run_local_world(_convert_and_check_world, world, (jobs(world), str(root), world == 2), timeout_s=TIMEOUT_S),
        )
    for case in CASES:
        results[case.name].files = sorted(p.name for p in (root / "out" / case.name).glob("rank_*.pt"))
    return results


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scenario(case: Case, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[case.name]
    if case.error:
        assert not outcome.ok and outcome.error, f"osdpipe converted an input it must refuse: {outcome}"
        assert all(s in outcome.error for s in case.error), (
            f"expected an error naming {case.error}, got: {outcome.error}"
        )
        assert outcome.files == [], "a refused conversion wrote rank files"
        assert outcome.pytorch and all(p == [] for p in outcome.pytorch), (
            f"PyTorch does not refuse it the same way: {outcome.pytorch}"
        )
        return
    assert outcome.ok, f"osdpipe failed: {outcome.error or outcome.failed_checks}"
    assert outcome.files == [f"rank_{r}.pt" for r in range(case.target.world_size)]
    assert len(outcome.pytorch) == case.target.world_size, "the PyTorch check did not run on every target rank"
    for rank, problems in enumerate(outcome.pytorch):
        assert not problems, f"rank {rank}: " + "; ".join(problems[:8])


def test_comparison_sees_one_changed_element_key_or_group_field(outcomes: dict[str, Outcome]) -> None:
    for rank, problems in enumerate(outcomes["<sensitivity>"].pytorch):
        assert not problems, f"rank {rank}: {problems}"


def test_unmanaged_parameter_is_named_in_a_warning(outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes["unmanaged_stays_unmanaged"]
    assert outcome.ok
    assert any("temperature" in w for w in outcome.warnings), (
        f"no warning names the unmanaged parameter: {outcome.warnings}"
    )
