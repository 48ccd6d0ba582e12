"""A pickled ``ShardedTensor`` (FSDP1's ``SHARDED_STATE_DICT``) read as data: this rank's shard and where it lies.

FSDP1 saves a sharded model state dict as ``ShardedTensor`` values: each rank's file holds its local shard of every
parameter (dim-0 chunks, as ``torch.chunk`` cuts them) and the metadata of every rank's shard. ``torch.load`` rebuilds
one only inside a process group of the saving world (its ``__setstate__`` asks for the rank), so osdpipe reads the
file inertly (:func:`osdpipe.io.formats.inert_load.load_inert`: the objects of ``torch.distributed._shard`` as records,
nothing of them run) and takes what it needs from the records: :func:`local_shard`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.inert_load import Record, load_inert, record_class

#: The packages a ``ShardedTensor``'s pickle names: its classes, its metadata's and its shards' placements.
DESCRIBED = ("torch.distributed._shard", "torch.distributed.remote_device")


@dataclass(frozen=True)
class LocalShard:
    """One rank's shard of a ``ShardedTensor``: its tensor, its offset in the whole, the whole's shape and dtype, and
    the device type its placement names (``cpu``, ``cuda``)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]
    device_type: str

    @property
    def whole(self) -> torch.Tensor:
        """The whole tensor's shape and dtype, as a tensor that holds no bytes (``meta``)."""
        return torch.empty(self.size, dtype=self.tensor.dtype, device="meta")


def _state(record: Record, where: str) -> dict[str, Any]:
    """A dataclass record's fields (pickled as ``(None, fields)``) or a plain object's (``fields``)."""
    state = record.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = state[1]
    if not isinstance(state, dict):
        raise InputError(f"{where}: a {record.name} pickled as {type(state).__name__}, not as its fields")
    return state


#: The record class a pickled ``ShardedTensor`` comes out as (one per pickled name: :func:`record_class`).
SHARDED_TENSOR = record_class("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")


def is_sharded_tensor(value: Any) -> bool:
    return isinstance(value, SHARDED_TENSOR)


def local_shard(value: Record, where: str) -> LocalShard:
    """This rank's one shard of the ``ShardedTensor`` record ``value`` (read from ``where``).

    Raises:
        InputError: naming ``where``: the record does not hold one local shard of the pickled structure.
    """
    state = value.state
    if not (isinstance(state, tuple) and len(state) >= 2 and isinstance(state[0], list)):
        raise InputError(f"{where}: a ShardedTensor pickled as {type(state).__name__}, not as its shards and metadata")
    shards, metadata = state[0], state[1]
    if len(shards) != 1:
        raise InputError(f"{where}: a ShardedTensor with {len(shards)} local shards on one rank; FSDP1 saves one")
    shard = _state(shards[0], where)
    shard_meta = _state(shard["metadata"], where)
    placement = shard_meta.get("placement")
    device = _state(placement, where).get("_device") if isinstance(placement, Record) else None
    return LocalShard(
        tensor=shard["tensor"],
        offsets=tuple(int(o) for o in shard_meta["shard_offsets"]),
        size=tuple(int(s) for s in _state(metadata, where)["size"]),
        device_type=getattr(device, "type", "cpu"),
    )


def load_sharded_state(path: Path, what: str) -> dict[str, Any]:
    """A ``torch.save`` file of a state dict whose values may be ``ShardedTensor``: each one a :class:`LocalShard`,
    the rest as stored."""
    state = load_inert(path, DESCRIBED, what=what)
    if not isinstance(state, dict):
        raise InputError(f"{path} holds a {type(state).__name__}, not a state dict; is it {what}?")
    return {key: local_shard(v, f"{path}: {key}") if is_sharded_tensor(v) else v for key, v in state.items()}
