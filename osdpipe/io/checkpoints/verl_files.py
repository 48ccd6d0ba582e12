"""veRL's own rank files, made for a job of another world size: each rank's DTensors on that job's mesh.

veRL's ``FSDPCheckpointManager`` loads ``model_world_size_<M>_rank_<r>.pt`` with ``model.load_state_dict`` and
``optim_world_size_<M>_rank_<r>.pt`` with ``optimizer.load_state_dict``. FSDP2 copies a DTensor only from one on an
equal ``DeviceMesh`` (the same ranks, layout, device type and dimension names), and the next step works on the
moments' DTensors beside the parameters'. So each file holds DTensors on a mesh equal to the M-rank job's.

osdpipe is not a rank of that job, and torch has no public way to make the mesh of a world one is not in. So
:func:`job_mesh` makes it with ``DeviceMesh``'s own ``_init_backend=False`` and ``_rank`` arguments (what torch itself
makes meshes without process groups with) and gives it the names of the process groups the job's mesh resolves at
load (``_dim_group_names``: a mesh of the whole world uses the default group), here alone: the tests load what it
makes with veRL's own manager and gather it over the job's groups, so a torch that changes them fails there. The
device type, dimension names and group names are the source job's (:func:`source_mesh`; an FSDP1 job's: veRL's FSDP2
mesh): veRL resumes the same job on another number of GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from osdpipe.io.formats.base import InputError
from osdpipe.layout.ranges import DTENSOR_TABLE

#: The dimension names of the mesh veRL's FSDP2 job makes (``create_device_mesh`` where ``fsdp_size`` is the world).
VERL_MESH_NAMES = ("fsdp",)
#: The name of a job's default process group, which a mesh over the whole world uses (torch's first group).
DEFAULT_GROUP = ("0",)
#: What a ``rank_local`` optimizer state holds besides PyTorch's own ``state`` and ``param_groups`` (osdpipe's record of
#: each parameter's layout), which veRL's files do not.
_OSDPIPE_ONLY = (DTENSOR_TABLE, "param_layout")


@dataclass(frozen=True)
class MeshSpec:
    """The one-dimensional FSDP mesh of a veRL job, but for its size: its device type and dimension names."""

    device_type: str
    dim_names: tuple[str, ...] | None
    #: The names of the process groups of its dimension, as the job resolves them (its default group's, "0").
    group_names: tuple[str, ...] = ()

    def said(self) -> str:
        names = f", dimension {self.dim_names[0]!r}" if self.dim_names else ""
        return f"a {self.device_type} mesh{names}"


def source_mesh(model_file: Any, fsdp_version: int = 2) -> MeshSpec:
    """The mesh the FSDP2 job that resumes a veRL save lays its DTensors on, but for its size: an FSDP2 save's own
    (the first DTensor of a rank's model file: every parameter shares it); for an FSDP1 save, veRL's FSDP2 mesh
    (``create_device_mesh``: one dimension, ``fsdp``, the default process group's) on the device type the save's
    ``ShardedTensor`` placements name.

    Raises:
        InputError: the file holds no DTensor (no ShardedTensor, for FSDP1), or one on a mesh of more than one
            dimension (HSDP), naming the file.
    """
    from osdpipe.io.formats.safe_load import load_torch_file  # memory-mapped: only the file's metadata is read

    if fsdp_version == 1:
        from osdpipe.io.checkpoints.rank_weights import load_fsdp1_model_file
        from osdpipe.io.formats.sharded_tensor import LocalShard

        shard = next((v for v in load_fsdp1_model_file(model_file).values() if isinstance(v, LocalShard)), None)
        if shard is None:
            raise InputError(f"{model_file} holds no ShardedTensor: not an FSDP1 rank's SHARDED_STATE_DICT")
        return MeshSpec(shard.device_type, VERL_MESH_NAMES, DEFAULT_GROUP)
    found = next((v for v in load_torch_file(model_file).values() if hasattr(v, "device_mesh")), None)
    if found is None:
        raise InputError(f"{model_file} holds no DTensor: not an FSDP2 rank's model.state_dict(); is it veRL's?")
    mesh = found.device_mesh
    if mesh.ndim != 1:
        raise InputError(
            f"{model_file}: its DTensors lie on a {mesh.ndim}-dimensional mesh {tuple(mesh.mesh.shape)} (HSDP, "
            "actor.fsdp_config.fsdp_size): veRL's files are written for a one-dimensional FSDP mesh only so far; "
            "write output.checkpoint=pytorch"
        )
    groups = tuple(getattr(mesh, "_dim_group_names", ()))  # the job's own groups, where its mesh had them
    return MeshSpec(mesh.device_type, tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None, groups)


def job_mesh(spec: MeshSpec, world_size: int, rank: int) -> Any:
    """The mesh rank ``rank`` of an FSDP2 job of ``world_size`` ranks lays its DTensors on, as that job makes it
    (``init_device_mesh(device_type, (world_size,), mesh_dim_names=...)``), made without that job's world."""
    from torch.distributed.device_mesh import DeviceMesh  # heavy: only where veRL's files are written

    mesh = DeviceMesh(
        spec.device_type, torch.arange(world_size), mesh_dim_names=spec.dim_names, _init_backend=False, _rank=rank
    )
    if spec.group_names:  # resolved by name where the job loads it, as its own mesh's are
        mesh._dim_group_names = list(spec.group_names)
    return mesh


def refuses_device(spec: MeshSpec) -> str | None:
    """Why this process cannot make DTensors on ``spec``'s device type (``None``: it can). ``DTensor.from_local``
    moves each local tensor onto its mesh's device type."""
    if torch.device(spec.device_type).type == "cpu":
        return None
    return (
        f"the source job's DTensors lie on {spec.said()}; osdpipe writes veRL's own files for a job on CPU meshes only "
        f"so far (a {spec.device_type} mesh's DTensors are made on the {spec.device_type} device); write "
        "output.checkpoint=pytorch, which a job on any device loads"
    )


def _sharded(local: torch.Tensor, shape: Any, mesh: Any) -> Any:
    """``local`` as this rank's dim-0 shard of a DTensor of ``shape`` on ``mesh``, as FSDP2's ``state_dict()`` gives
    it: the local tensor itself (its storage is what is written), no copy."""
    from torch.distributed.tensor import DTensor, Shard  # heavy: only where veRL's files are written

    shape = tuple(shape)
    stride = tuple(int(torch.Size(shape[i + 1:]).numel()) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def model_file(model: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], mesh: Any) -> dict[str, Any]:
    """A rank's ``model.state_dict()`` as FSDP2 gives it: each parameter of ``shapes`` (by state name, its whole
    shape) a DTensor of its local rows; the rest (buffers, 0-dim parameters) as it is."""
    return {name: _sharded(value, shapes[name], mesh) if shapes.get(name) else value for name, value in model.items()}


def optim_file(optimizer: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """A rank's ``optimizer.state_dict()`` as FSDP2 gives it, from osdpipe's ``rank_local`` form of it: every state
    tensor of a parameter's shape a DTensor on ``mesh`` (the parameter's whole shape from the ``dtensor`` table),
    the step counters as they are; osdpipe's own tables left out."""
    table = optimizer.get(DTENSOR_TABLE, {})
    state = {
        pid: {
            name: _sharded(value, table[pid]["shape"], mesh) if torch.is_tensor(value) and value.dim() > 0 else value
            for name, value in entry.items()
        }
        for pid, entry in optimizer["state"].items()
    }
    return {key: value for key, value in optimizer.items() if key not in _OSDPIPE_ONLY} | {"state": state}


def local_view(state: Any) -> Any:
    """``state`` with every DTensor as what makes it up: its local tensor, whole shape, placements and mesh (device
    type, ranks, dimension names): what two of veRL's files are compared by, with no process group."""
    if isinstance(state, dict):
        return {key: local_view(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_view(value) for value in state)
    mesh = getattr(state, "device_mesh", None)
    if mesh is None:
        return state
    return {
        "local": state.to_local(),
        "shape": list(state.shape),
        "placements": [str(p) for p in state.placements],
        "mesh": [mesh.device_type, mesh.mesh.tolist(), list(mesh.mesh_dim_names or ())],
    }


def extra_state_source(rank: int, saved_world: int) -> int:
    """The saving job's rank whose extra state (scheduler, RNG) target rank ``rank`` takes: its own where it was in
    that world, else ``rank mod saved_world``'s (the scheduler's state is every rank's; the RNG streams of a rank
    beyond the saving world repeat that rank's)."""
    return rank % saved_world
