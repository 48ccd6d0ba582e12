"""A whole checkpoint's model weights in one file per rank: each rank's ``model.state_dict()`` of its FSDP job, every
parameter a dim-0 shard: FSDP2's DTensors, or FSDP1's ``ShardedTensor`` (veRL's ``model_world_size_<W>_rank_<r>.pt``).

The weights travel as one more state of each parameter (:mod:`osdpipe.io.weights`), so they are read as the rank's
optimizer state is: by :class:`~osdpipe.io.formats.rank_local.RankLocalReader`, each file presented as a state keyed
by parameter index whose one entry is the weights. Where each element lies is the source layout's, the one model of
it (:func:`osdpipe.layout.kinds.rank_layout`); every local shard is checked against it, a ``ShardedTensor``'s offset
too.
"""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.io.formats.base import WEIGHTS, InputError, TensorRef, describe_value, local_part
from osdpipe.io.formats.rank_local import RankFileNaming, RankLocalReader
from osdpipe.io.formats.safe_load import load_torch_file
from osdpipe.io.formats.sharded_tensor import LocalShard, load_sharded_state
from osdpipe.io.weights import ModelMeta, model_meta_of, stored_names
from osdpipe.layout.ranges import LayoutSpec, chunk_bounds
from osdpipe.layout.tree import ModuleTree


def load_model_file(path: Any) -> dict[str, Any]:
    """An FSDP2 rank's ``model.state_dict()`` file: DTensors (and plain buffers), loaded memory-mapped."""
    return load_torch_file(path)


def load_fsdp1_model_file(path: Any) -> dict[str, Any]:
    """An FSDP1 rank's ``SHARDED_STATE_DICT`` file: each ``ShardedTensor`` a
    :class:`~osdpipe.io.formats.sharded_tensor.LocalShard`, read inertly."""
    return load_sharded_state(path, "an FSDP1 rank's model file (model.state_dict() under SHARDED_STATE_DICT)")


def _local(value: Any) -> Any:
    """A stored value's local piece: a ShardedTensor's shard, a DTensor's local tensor, else the value."""
    return value.tensor if isinstance(value, LocalShard) else local_part(value)


def _whole(value: Any) -> Any:
    """A stored value with its whole shape (what the model's metadata is made of): a ShardedTensor's as a ``meta``
    tensor, a DTensor itself (its shape is the whole's), a buffer as it is."""
    return value.whole if isinstance(value, LocalShard) else value


class _ModelFiles(RankLocalReader):
    """Each rank's model file as a state keyed by parameter index, its one entry the weights' local shard."""

    def __init__(
        self, path: str, tree: ModuleTree, source: LayoutSpec, naming: RankFileNaming, load: Any = load_model_file
    ) -> None:
        super().__init__(path, tree, source, None, naming)
        self.load = load
        self.stored: dict[int, dict[str, Any]] = {}  # each rank's file, whole-shaped, by rank (its buffers, its names)

    def _osd(self, rank: int) -> dict[str, Any]:
        if rank not in self._osds:
            path = self.files[rank]
            state = self.load(path)
            if not isinstance(state, dict) or not all(
                isinstance(k, str) and (torch.is_tensor(v) or isinstance(v, LocalShard)) for k, v in state.items()
            ):
                raise InputError(f"{path} holds no model state dict (names to tensors); is it a rank's model file?")
            local = {name: _local(value) for name, value in state.items()}
            by_index = {}
            for index in range(len(self.order)):
                name = self.tensor(rank, index).key
                if name not in local:
                    raise InputError(f"{path}: rank {rank} has no {name}; is it this model's save?")
                self._check_offset(rank, name, state[name])
                by_index[index] = {WEIGHTS: local[name]}
            osd = {"state": by_index, "param_groups": None}
            self._check(rank, osd)
            self._osds[rank] = osd
            self.stored[rank] = {name: _whole(value) for name, value in state.items()}
        return self._osds[rank]

    def _check_offset(self, rank: int, name: str, value: Any) -> None:
        """A ShardedTensor's shard starts at the row the source layout's dim-0 chunk does (its shape is checked with
        every state's): a file of another chunking is refused, not read into the wrong rows."""
        if not isinstance(value, LocalShard):
            return
        first, _, _ = chunk_bounds(value.size[0] if value.size else 0, self.source.world_size, rank)
        expected = (first, *[0] * (len(value.size) - 1))
        if value.offsets != expected and value.tensor.numel():
            raise InputError(
                f"{self.files[rank]}: rank {rank}'s shard of {name} starts at {list(value.offsets)}, but a dim-0 "
                f"chunk of {self.source.world_size} ranks starts at {list(expected)}; is it an FSDP1 "
                "SHARDED_STATE_DICT file of this world?"
            )


class RankFileWeights:
    """The model's weights in each rank's ``model.state_dict()`` file, laid out as ``source`` (dim-0 chunks).

    Args:
        path: the folder of the files.
        tree: the model's module tree.
        source: the layout of the job that saved them.
        naming: how each rank's file is named.
        load: how one file is read (:func:`load_model_file`, :func:`load_fsdp1_model_file`).
    """

    def __init__(
        self, path: str, tree: ModuleTree, source: LayoutSpec, naming: RankFileNaming, load: Any = load_model_file
    ) -> None:
        self.tree = tree
        self.files = _ModelFiles(path, tree, source, naming, load)
        self._names: dict[str, str] | None = None

    def _rank0(self) -> dict[str, Any]:
        self.files._osd(0)
        return self.files.stored[0]

    def model_meta(self) -> ModelMeta:
        """Each parameter's full shape and dtype (a DTensor's global shape), and the buffers whole (rank 0's copy:
        FSDP2 replicates them)."""
        state = self._rank0()
        stored: dict[str, TensorRef] = {
            name: describe_value(value) for name, value in state.items() if self.tree.holds_weights(name)
        }
        buffers = {
            name: local_part(value).clone() for name, value in state.items() if not self.tree.holds_weights(name)
        }
        return model_meta_of(stored, buffers, self.tree, str(self.files.files[0]))

    def stored_name(self, name: str) -> str | None:
        if self._names is None:
            self._names = stored_names(self._rank0(), self.tree)
        return self._names.get(name)

    def read_weights(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.files.read_range(name, WEIGHTS, start, stop)
