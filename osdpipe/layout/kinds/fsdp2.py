"""``fsdp2``: ``fully_shard``: every parameter a DTensor, sharded on dim 0 over the mesh.

Each parameter is cut along dim 0 as ``torch.chunk`` cuts it: ``ceil(rows /
shards)`` rows per rank, trailing ranks fewer or none, the local tensor not
padded. A dim-0 chunk of a contiguous tensor is one contiguous range of its
flattened view, so every local tensor is one segment. With HSDP
(``shard_group_size``) the mesh is (replicate, shard): the parameter is cut
over the shard dimension and every replica group holds the same chunks.

With tensor parallelism (``tp_size``, ``tp_plan``) the job's mesh is
torchtitan's ``(dp, tp)`` or ``(dp_replicate, dp_shard, tp)``: the plan cuts
a parameter's dim 0 or 1 over ``tp`` first, then FSDP2 cuts dim 0 of that
piece over the data-parallel ranks. Each rank's piece is then a box (a range
per dimension, :mod:`osdpipe.layout.boxes`), whose rows become segments; the
placements come from PyTorch itself (:meth:`FSDP2.settle`). The
optimizer sees the parameters in the model's own order, and keeps
``exp_avg``-like state as DTensors of the parameter's placement, ``step`` as a
plain tensor; a rank with an empty chunk still has state (empty tensors).

Which modules are units (``wrap``) changes when FSDP2 gathers, never the
layout; the root is always a unit, as in torchtitan. A ``rank_local`` file of
this kind holds the local tensors of each DTensor plus a ``"dtensor"`` table
of placements (:func:`to_rank_local`), which :func:`from_rank_local` turns
back into what ``optim.load_state_dict`` takes. Plain tensors keep the file
loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from osdpipe.layout.boxes import Box, local_box, mesh_coordinates, parse_placement, placement_cuts
from osdpipe.layout.kinds.base import LayoutKind, compute_device, device_mesh, register
from osdpipe.layout.kinds.fsdp1 import check_shard_group
from osdpipe.layout.ranges import (
    DTENSOR_TABLE,
    LayoutSpec,
    LocalTensor,
    Placement,
    box_segments,
    same_placement,
    unit_of,
    wrapped_modules,
)
from osdpipe.layout.tp import mesh_shape, parallelize, read_placements
from osdpipe.layout.tree import ModuleTree, describe


def placement(spec: LayoutSpec) -> Placement:
    """The mesh and placements of every parameter of a job without tensor parallelism:
    ``Shard(0)``, or ``(Replicate(), Shard(0))`` with HSDP."""
    if spec.shard_group_size:
        return Placement(
            mesh=(spec.replicas, spec.shard_group_size), placements=("R", "S(0)"), names=("replicate", "shard")
        )
    return Placement(mesh=(spec.world_size,), placements=("S(0)",), names=("shard",))


def job_mesh(spec: LayoutSpec) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The job's whole device mesh and its dimension names: ``(world,)`` or ``(replicate, shard)``;
    with TP, torchtitan's (:func:`osdpipe.layout.tp.mesh_shape`)."""
    if spec.tp_size > 1:
        return mesh_shape(spec)
    where = placement(spec)
    return where.mesh, where.names


def placements(tree: ModuleTree, spec: LayoutSpec) -> dict[str, Placement]:
    """Each parameter's mesh and placements:
    :func:`placement` for all, or with TP as PyTorch lays them (``spec.tp_placements``)."""
    if spec.tp_size == 1:
        where = placement(spec)
        return {p.fqn: where for p in tree.params}
    if spec.tp_placements is None:
        raise ValueError(
            f"tp_size={spec.tp_size}: the parameters' placements are read from PyTorch by the plan "
            "(osdpipe.layout.tp.read_placements) before a layout is computed"
        )
    return dict(spec.tp_placements)


def rank_coordinates(spec: LayoutSpec, rank: int) -> dict[str, int]:
    """Rank ``rank``'s index along each named dimension of the job's mesh."""
    shape, names = job_mesh(spec)
    return dict(zip(names, mesh_coordinates(rank, shape), strict=True))


def held_box(shape: tuple[int, ...], tensor: LocalTensor) -> Box | None:
    """The box ``tensor`` holds of a parameter of ``shape``
    (its first element's index, and its local shape); ``None`` when it holds nothing."""
    if not tensor.segments:
        return None
    first, index = tensor.segments[0].start, []
    for size in reversed(shape):
        first, i = divmod(first, size)
        index.append(i)
    return tuple((start, start + n) for start, n in zip(reversed(index), tensor.shape, strict=True))


def pytorch_box(where: Placement, shape: tuple[int, ...], coords: dict[str, int]) -> Box:
    """The box PyTorch's offset helper (what DCP saves and loads by) says the rank at ``coords`` holds."""
    # private, as of torch 2.13: the helper behind compute_local_shape_and_global_offset,
    # taking plain coordinates instead of a live mesh
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    objects = []
    for text in where.placements:
        dim, factor = parse_placement(text)
        objects.append(
            Replicate() if dim is None else Shard(dim) if factor is None else _StridedShard(dim, split_factor=factor)
        )
    local, offset = _compute_local_shape_and_global_offset(shape, where.mesh, [coords[n] for n in where.names], objects)
    return tuple((o, o + n) for o, n in zip(offset, local, strict=True))


@register
class FSDP2(LayoutKind):
    name = "fsdp2"
    state_dict_types = ("full", "sharded", "local")
    hybrid = True
    dtensor_state = True
    tensor_parallel = True
    broadcasts_full_model = True

    def rank_layout(self, tree: ModuleTree, spec: LayoutSpec, rank: int) -> tuple[LocalTensor, ...]:
        """Each parameter's box on this rank (:mod:`osdpipe.layout.boxes`):
        the nested ``torch.chunk`` cuts its placements make, at this rank's mesh coordinates."""
        coords = rank_coordinates(spec, rank)
        table = placements(tree, spec)
        out = []
        for p in tree.params:
            where = table[p.fqn]
            box = local_box(p.shape, placement_cuts(where.placements, where.mesh, [coords[n] for n in where.names]))
            local_shape = tuple(stop - start for start, stop in box)
            segments = box_segments(p.fqn, p.shape, box)
            out.append(
                LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=local_shape, segments=segments, flat=False, placement=where)
            )
        return tuple(out)

    def settle(self, spec: LayoutSpec, factory: str, kwargs: dict[str, Any]) -> LayoutSpec:
        """With tensor parallelism, the placements PyTorch gives each parameter
        (:func:`osdpipe.layout.tp.read_placements`)."""
        if spec.tp_size == 1 or spec.tp_placements is not None:
            return spec
        return dataclasses.replace(spec, tp_placements=read_placements(factory, kwargs, spec))

    def dcp_load_problem(self, tree: ModuleTree, spec: LayoutSpec) -> str | None:
        """Where PyTorch's offset helper, which ``dcp.load`` places pieces by, disagrees with what a rank really holds.

        PyTorch 2.13's ``compute_local_shape_and_global_offset`` misplaces
        ``_StridedShard`` pieces on some meshes (dp 4 x tp 2, for one): a
        DCP output, however right, would load into the wrong rows there.
        The real pieces are the nested ``torch.chunk`` boxes of
        :meth:`rank_layout`, tested against real jobs.
        """
        if spec.tp_size == 1:
            return None  # no strided shard: the helper is right
        for rank in range(spec.world_size):
            coords = rank_coordinates(spec, rank)
            for tensor in self.rank_layout(tree, spec, rank):
                shape = tree.param(tensor.key).shape
                box = held_box(shape, tensor)
                theirs = pytorch_box(tensor.placement, shape, coords) if box is not None else None
                if theirs != box:
                    return (
                        f"dcp.load would put rank {rank}'s piece of {tensor.key} at {theirs}, but the rank holds {box} "
                        f"(PyTorch {torch.__version__}'s offsets for {', '.join(tensor.placement.placements)} "
                        f"on mesh {list(tensor.placement.mesh)} are wrong); "
                        "write output.format=rank_local, or choose a mesh where they are right"
                    )
        return None

    def validate(self, spec: LayoutSpec) -> None:
        """HSDP is ``shard_group_size``; ``fully_shard`` always wraps
        the root and has no strategies besides when it reshards."""
        if spec.sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise ValueError(
                f"sharding_strategy={spec.sharding_strategy}: kind=fsdp2 shards every parameter "
                "(FULL_SHARD or SHARD_GRAD_OP, which lay out alike); for HSDP set shard_group_size"
            )
        if not spec.wrap_root:
            raise ValueError("wrap_root=false: fully_shard always wraps the root module; leave wrap_root=true")
        check_shard_group(spec, hybrid=spec.shard_group_size is not None)
        if spec.tp_size > 1 and not spec.tp_plan:
            raise ValueError(
                f"tp_size={spec.tp_size} needs tp_plan: "
                "module FQN patterns mapped to colwise, rowwise, sequence or package.module:callable"
            )

    def check(self, tree: ModuleTree, spec: LayoutSpec) -> None:
        """Unknown wrap names, tied parameters across units, 0-dim parameters (which ``Shard(0)`` cannot cut)."""
        unit_of(tree, spec)
        scalars = [p.fqn for p in tree.params if not p.shape]
        if scalars:
            raise ValueError(
                f"FSDP2 shards every parameter on dim 0, but {', '.join(scalars[:3])} are 0-dim; reshape them to (1,)"
            )

    def wrap(self, model: nn.Module, spec: LayoutSpec) -> nn.Module:
        """``tp_plan`` applied over the ``tp`` mesh dimension (with TP),
        then ``fully_shard`` on every module of ``wrap``, innermost first, and on the root."""
        # heavy: only a live model needs it, not the launcher's config check
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = device_mesh(*job_mesh(spec))
        policy = (
            MixedPrecisionPolicy(param_dtype=getattr(torch, spec.param_dtype))
            if spec.param_dtype
            else MixedPrecisionPolicy()
        )
        model = model.to(compute_device())
        if spec.tp_size > 1:  # tensor parallelism first, over the mesh's tp dimension; FSDP2 then shards over the rest
            mesh = parallelize(model, mesh, spec)
        units = [u for u in wrapped_modules(describe(model), spec) if u]
        for name in reversed(units):  # reversed pre-order: every unit before its ancestors
            fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    def to_load(self, model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> dict[str, Any]:
        """``set_optimizer_state_dict`` from the full state (:meth:`load_full`),
        then ``optim.state_dict()``, as a ``rank_local`` file holds it.

        ``optim`` is left holding the loaded state.
        """
        self.load_full(model, optim, full_osd)
        return to_rank_local(optim.state_dict())

    def load_full(self, model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> None:
        """``set_optimizer_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``:
        what an FSDP2 job calls with a full state.

        ``broadcast_from_rank0``: rank 0's full state is sent to every rank,
        which keeps its piece. Without it PyTorch 2.13 cuts each rank's piece
        with ``distribute_tensor``, which fails for an uneven ``_StridedShard``
        (FSDP2 over tensor parallelism, a size that ``tp_size`` does not divide).
        """
        # DCP is heavy: only a live model needs it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # PyTorch needs groups to load by; a source without them resumes with the target's
        if "param_groups" not in full_osd:
            full_osd = {**full_osd, "param_groups": self.full_state(model, optim)["param_groups"]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            set_optimizer_state_dict(
                model, optim, full_osd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )

    def loadable(self, optim: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        return from_rank_local(optim, state)

    def full_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """``get_optimizer_state_dict`` with ``full_state_dict``, on every rank.

        PyTorch logs a warning per rank when it gathers a ``_StridedShard``
        in two steps (FSDP2 over TP); that is how it is done, not a problem
        of the checkpoint, so it is not shown.
        """
        # DCP is heavy: only a live model needs it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))

    def save(self, model: nn.Module, optim: torch.optim.Optimizer, path: Path, state_dict_type: str, key: str) -> None:
        """full: the full state from rank 0; sharded: ``get_optimizer_state_dict`` to DCP;
        local: :func:`to_rank_local` per rank."""
        if state_dict_type == "local":
            path.mkdir(exist_ok=True)
            torch.save(to_rank_local(optim.state_dict()), path / f"rank_{dist.get_rank()}.pt")
        elif state_dict_type == "full":
            osd = self.full_state(model, optim)
            if dist.get_rank() == 0:
                torch.save(osd, path)
        else:
            # DCP is heavy: only a sharded save needs it
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save({key: get_optimizer_state_dict(model, optim)}, checkpoint_id=str(path))


def to_rank_local(osd: dict[str, Any]) -> dict[str, Any]:
    """An FSDP2 rank's ``optim.state_dict()`` as a ``rank_local`` file holds it.

    Every DTensor becomes its local tensor, and ``osd["dtensor"][param_id]``
    records the parameter's global shape, mesh shape and placements, so that
    :func:`from_rank_local` can rebuild it and check it against the model it
    is loaded into. This is how an FSDP2 job saves ``rank_local`` input::

        torch.save(osdpipe.to_rank_local(optim.state_dict()), f"{dir}/rank_{rank}.pt")
    """
    from torch.distributed.tensor import DTensor  # heavy: only where FSDP2 state is read or saved

    state: dict[Any, Any] = {}
    table: dict[Any, dict[str, Any]] = {}
    for pid, entry in osd["state"].items():
        state[pid] = {}
        for name, value in entry.items():
            if isinstance(value, DTensor):
                table[pid] = _describe(value)
                value = value.to_local()
            state[pid][name] = value
    return {**osd, "state": state, DTENSOR_TABLE: table}


def from_rank_local(optim: torch.optim.Optimizer, osd: dict[str, Any]) -> dict[str, Any]:
    """What ``optim.load_state_dict`` takes from a ``rank_local`` file of an FSDP2 rank (:func:`to_rank_local`).

    Each local tensor becomes a DTensor on its parameter's mesh and
    placements. The file's placements must be the parameter's, else the state
    belongs to another layout.

    Raises:
        ValueError: naming the param ID whose shape or placement differs.
    """
    from torch.distributed.tensor import DTensor  # heavy: only where FSDP2 state is loaded

    params = [p for g in optim.param_groups for p in g["params"]]
    table = osd.get(DTENSOR_TABLE, {})
    state: dict[Any, Any] = {}
    for pid, entry in osd["state"].items():
        param = params[pid] if isinstance(pid, int) and pid < len(params) else None
        if not isinstance(param, DTensor):
            state[pid] = entry
            continue
        saved = table.get(pid)
        here = _describe(param)
        if saved is not None and not same_placement(saved, here):
            raise ValueError(
                f"param ID {pid}: the file's DTensor is {saved}, but the optimizer's parameter is {here}; "
                "convert to this layout first"
            )
        state[pid] = {
            name: DTensor.from_local(
                value.to(param.device), param.device_mesh, param.placements,
                run_check=False, shape=param.shape, stride=param.stride(),
            )
            if torch.is_tensor(value) and value.dim() > 0
            else value
            for name, value in entry.items()
        }
    return {k: v for k, v in osd.items() if k != DTENSOR_TABLE} | {"state": state}


def _describe(dtensor: Any) -> dict[str, list[Any]]:
    """A live DTensor's entry of the ``dtensor`` table,
    as :meth:`osdpipe.layout.ranges.Placement.describe` writes it, its mesh's names included."""
    mesh = dtensor.device_mesh
    return Placement(
        tuple(mesh.shape), tuple(str(p) for p in dtensor.placements), tuple(mesh.mesh_dim_names or ())
    ).describe(tuple(dtensor.shape))
