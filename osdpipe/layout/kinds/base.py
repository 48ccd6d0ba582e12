"""What every layout kind is and does, and the registry they join (the kinds themselves are in their own modules).

Kept apart from :mod:`osdpipe.layout.kinds`, which imports every kind to fill the
registry, so that a kind module imports this one and never its package:
no import cycle.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from osdpipe.core.registry import member
from osdpipe.layout.ranges import LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree


class LayoutKind:
    """One way of wrapping a model. Subclasses set :attr:`name` and implement the methods."""

    name: ClassVar[str]
    #: The state-dict types a job of this kind saves (``source.state_dict_type``).
    state_dict_types: ClassVar[tuple[str, ...]] = ("full",)
    #: Whether every rank holds every parameter whole (its state is a ``plain`` one, the same on every rank).
    replicated: ClassVar[bool] = False
    #: What a checkpoint of this kind's job is, where that job is one process,
    #: in a few words (``<path> is ...``); ``None``: it may be several.
    one_process: ClassVar[str | None] = None
    #: Whether a job of this kind can cut its parameters over shard groups of ``shard_group_size`` ranks,
    #: replicated across the groups (HSDP).
    hybrid: ClassVar[bool] = False
    #: Whether the layout depends on ``use_orig_params``
    #: (a job's optimizer sees flat parameters or each parameter's piece).
    has_use_orig_params: ClassVar[bool] = False
    #: Whether its optimizer keeps state as DTensors,
    #: which a ``rank_local`` file keeps with a ``dtensor`` table of their placements.
    dtensor_state: ClassVar[bool] = False
    #: Whether a job of this kind can add tensor parallelism (``tp_size``, ``tp_plan``) inside its data parallelism.
    tensor_parallel: ClassVar[bool] = False
    #: Whether PyTorch's full model load (:meth:`load_model_full`) must send rank 0's
    #: tensors to the others (``broadcast_from_rank0``), as for FSDP2's optimizer
    #: state (:meth:`osdpipe.layout.kinds.fsdp2.FSDP2.load_full` says why).
    broadcasts_full_model: ClassVar[bool] = False
    #: Whether a sharded optimizer load is templated by the live optimizer's own state dict (FSDP1's
    #: ``FSDP.optim_state_dict``), which is empty before its first step: a ``dcp.load`` into a fresh optimizer then
    #: loads nothing, and a framework that loads so (accelerate's ``load_state``) says nothing.
    sharded_load_needs_a_stepped_optimizer: ClassVar[bool] = False
    #: Why osdpipe builds no live job of this kind for the checks that load into one (``None``: it builds one with
    #: :meth:`wrap`): a framework that builds its own model and optimizer (Megatron-Core).
    no_live_job: ClassVar[str | None] = None
    #: The optimizer state that holds the parameter its optimizer steps, where that is a master copy of its own
    #: (Megatron's distributed optimizer keeps the fp32 master as ``param``); ``None``: the model's parameter.
    master_state: ClassVar[str | None] = None

    def hybrid_keys(self, shard_group_size: int) -> dict[str, Any]:
        """The layout keys (``source.*``, ``target.*``) of a hybrid-sharded job of this kind with shard groups of
        ``shard_group_size`` ranks; none where it has none."""
        return {"shard_group_size": shard_group_size} if self.hybrid else {}

    def saved_format(self, state_dict_type: str) -> str:
        """The input format of what :meth:`save` writes for ``state_dict_type``."""
        return {"full": "fsdp_full", "sharded": "dcp", "local": "rank_local"}[state_dict_type]

    def refuses_output(self, fmt: Any) -> str | None:
        """Why this kind's optimizer cannot load format ``fmt`` (``None``: it can);
        the message names the keys to set."""
        return None

    def rank_layout(self, tree: ModuleTree, spec: LayoutSpec, rank: int) -> tuple[LocalTensor, ...]:
        """The local tensors of rank ``rank``'s optimizer, in ``model.parameters()`` order of the wrapped model."""
        raise NotImplementedError

    def left_out(self, tree: ModuleTree, spec: LayoutSpec) -> dict[str, tuple[int, int]]:
        """The elements of each parameter (a flat range of it, by canonical FQN) the layout leaves out of the model on
        purpose, which no rank holds: none by default (Megatron's vocabulary padded to fewer rows than the source's)."""
        return {}

    def unmanaged(self, tree: ModuleTree, spec: LayoutSpec) -> list[str]:
        """Parameters the wrapping leaves to the user to keep in step across ranks (none by default)."""
        return []

    def validate(self, spec: LayoutSpec) -> None:
        """Raise ``ValueError`` naming the key to change
        when this kind cannot be wrapped as ``spec`` says (no model needed).

        By default: every rank holds every parameter, so there is nothing to shard.
        """
        if spec.shard_group_size is not None:
            raise ValueError(
                f"shard_group_size={spec.shard_group_size}: kind={self.name} does not shard; leave it unset"
            )
        if spec.sharding_strategy != "FULL_SHARD":
            raise ValueError(
                f"sharding_strategy={spec.sharding_strategy}: kind={self.name} does not shard; leave it at FULL_SHARD"
            )

    def settle(self, spec: LayoutSpec, factory: str, kwargs: dict[str, Any]) -> LayoutSpec:
        """``spec`` with what only the model (``factory(**kwargs)``) and PyTorch can add,
        asked once by the plan; by default nothing."""
        return spec

    def dcp_load_problem(self, tree: ModuleTree, spec: LayoutSpec) -> str | None:
        """Why ``dcp.load`` on a job wrapped as ``spec`` would put pieces in the wrong place
        (``None``: it would not); by default it would not."""
        return None

    def check(self, tree: ModuleTree, spec: LayoutSpec) -> None:
        """Raise ``ValueError`` when ``spec`` cannot wrap this model (checked before any process starts)."""

    def wrap(self, model: nn.Module, spec: LayoutSpec) -> nn.Module:
        """``model`` wrapped as ``spec`` says, inside an initialized process group where the kind needs one."""
        raise NotImplementedError

    def to_load(self, model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> dict[str, Any]:
        """PyTorch's conversion of a full FQN-keyed state into what this rank's ``optim.load_state_dict`` takes."""
        raise NotImplementedError

    def load_full(self, model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> None:
        """Load a full FQN-keyed state into this rank's optimizer the way a job of this kind does
        (what an ``fsdp_full`` or ``dcp`` output is for)."""
        optim.load_state_dict(self.loadable(optim, self.to_load(model, optim, full_osd)))

    def loadable(self, optim: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes from a ``rank_local`` file of this kind
        (the file itself, unless it holds DTensors)."""
        return state

    def full_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """PyTorch's full, FQN-keyed optimizer state of a live model, on every rank."""
        raise NotImplementedError

    def load_model_full(self, model: nn.Module, full_sd: dict[str, Any], *, hooked: bool = False) -> None:
        """PyTorch's own load of a full, FQN-keyed model state dict into this rank's live model
        (``set_model_state_dict``, full; ``broadcast_from_rank0`` where :attr:`broadcasts_full_model` says so).

        ``hooked``: the model's state-dict hooks make keys of its parameters' rows, which PyTorch's
        ``set_model_state_dict`` cannot place (it looks each key up as a parameter); the model's own
        ``load_state_dict`` takes them instead, each value laid out as the model's own ``state_dict()``
        holds it, as torchtitan loads a checkpoint.
        """
        # DCP is heavy: only a live model needs it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if hooked:
            model.load_state_dict(
                {name: _laid_out_as(full_sd[name], held) for name, held in model.state_dict().items()}
            )
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.broadcasts_full_model)
            set_model_state_dict(model, full_sd, options=options)

    def full_model_state(self, model: nn.Module, *, hooked: bool = False) -> dict[str, Any]:
        """PyTorch's own full, FQN-keyed model state dict of a live model (``get_model_state_dict``, full), on every
        rank (``hooked``: the model's own ``state_dict()``, each value gathered whole; see :meth:`load_model_full`)."""
        # DCP is heavy: only a live model needs it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if hooked:
            return {name: _whole(value) for name, value in model.state_dict().items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def save(self, model: nn.Module, optim: torch.optim.Optimizer, path: Path, state_dict_type: str, key: str) -> None:
        """Save the optimizer state as a job of this kind does (collective: every rank calls it)."""
        raise NotImplementedError


def _laid_out_as(full: torch.Tensor, held: Any) -> Any:
    """``full`` laid out as ``held`` (a value of a live model's own ``state_dict()``):
    a DTensor's placements on its mesh, else as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # DTensor: only a live model needs it

    if isinstance(held, DTensor):
        return distribute_tensor(full.to(held.dtype), held.device_mesh, held.placements)
    return full


def _whole(value: Any) -> Any:
    """A live model's state-dict value whole on every rank (a DTensor gathered)."""
    from torch.distributed.tensor import DTensor  # DTensor: only a live model needs it

    return value.full_tensor() if isinstance(value, DTensor) else value


KINDS: dict[str, LayoutKind] = {}
K = TypeVar("K", bound=type[LayoutKind])


def register(cls: K) -> K:
    """Register a kind under its ``name``."""
    if cls.name in KINDS:
        raise ValueError(f"layout kind {cls.name!r} is registered twice")
    KINDS[cls.name] = cls()
    return cls


def get(name: str) -> LayoutKind:
    """The kind called ``name``.

    Raises:
        ValueError: naming the kinds there are.
    """
    return member(KINDS, name, "layout kind")


def find(name: Any) -> LayoutKind | None:
    """The kind called ``name``, or ``None`` where no kind is
    (what a checkpoint's files show may be none: ``sharded``, nothing, a damaged manifest's value)."""
    return KINDS.get(name) if isinstance(name, str) else None


def compute_device() -> torch.device:
    """The device a wrapped model computes on: this rank's GPU when CUDA is present, else the CPU."""
    if torch.cuda.is_available():  # GPU path: one device per local rank
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# (device, shape, names) -> (world, mesh)
_MESHES: dict[tuple[str, tuple[int, ...], tuple[str, ...]], tuple[Any, Any]] = {}


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    """The device mesh of ``shape`` over the current world, its dimensions called ``names``.

    By default ``(world,)`` is ``("shard",)`` and a 2-D mesh, for hybrid
    sharding, ``("replicate", "shard")``.

    Made once per world: making a mesh makes process groups, a collective
    that every rank would otherwise repeat for each model verify builds.
    """
    device = compute_device().type
    names = names or (("replicate", "shard") if len(shape) == 2 else ("shard",))
    world, mesh = _MESHES.get((device, shape, names), (None, None))
    if world is not dist.group.WORLD:  # the cache holds its world, so a new world is never mistaken for it
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
        _MESHES[(device, shape, names)] = (dist.group.WORLD, mesh)
    return mesh
