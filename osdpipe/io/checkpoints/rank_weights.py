"""A whole checkpoint's model weights in one file per rank: each rank's ``model.state_dict()`` of its FSDP2 job,
every parameter a DTensor shard (veRL's ``model_world_size_<W>_rank_<r>.pt``).

The weights travel as one more state of each parameter (:mod:`osdpipe.io.weights`), so they are read as the rank's
optimizer state is: by :class:`~osdpipe.io.formats.rank_local.RankLocalReader`, each file presented as a state keyed
by parameter index whose one entry is the weights. Where each element lies is the source layout's, the one model of
it (:func:`osdpipe.layout.kinds.rank_layout`); every local shard is checked against it.
"""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.io.formats.base import WEIGHTS, InputError, TensorRef, describe_value, local_part
from osdpipe.io.formats.rank_local import RankFileNaming, RankLocalReader
from osdpipe.io.formats.safe_load import load_torch_file
from osdpipe.io.weights import ModelMeta, model_meta_of, stored_names
from osdpipe.layout.ranges import LayoutSpec
from osdpipe.layout.tree import ModuleTree


class _ModelFiles(RankLocalReader):
    """Each rank's model file as a state keyed by parameter index, its one entry the weights' local shard."""

    def __init__(self, path: str, tree: ModuleTree, source: LayoutSpec, naming: RankFileNaming) -> None:
        super().__init__(path, tree, source, None, naming)
        self.stored: dict[int, dict[str, Any]] = {}  # each rank's file as loaded, by rank (its buffers, its names)

    def _osd(self, rank: int) -> dict[str, Any]:
        if rank not in self._osds:
            path = self.files[rank]
            state = load_torch_file(path)
            if not isinstance(state, dict) or not all(
                isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()
            ):
                raise InputError(f"{path} holds no model state dict (names to tensors); is it a rank's model file?")
            local = {name: local_part(value) for name, value in state.items()}
            by_index = {}
            for index in range(len(self.order)):
                name = self.tensor(rank, index).key
                if name not in local:
                    raise InputError(f"{path}: rank {rank} has no {name}; is it this model's save?")
                by_index[index] = {WEIGHTS: local[name]}
            osd = {"state": by_index, "param_groups": None}
            self._check(rank, osd)
            self._osds[rank] = osd
            self.stored[rank] = state
        return self._osds[rank]


class RankFileWeights:
    """The model's weights in each rank's ``model.state_dict()`` file, laid out as ``source`` (an FSDP2 job).

    Args:
        path: the folder of the files.
        tree: the model's module tree.
        source: the layout of the job that saved them.
        naming: how each rank's file is named.
    """

    def __init__(self, path: str, tree: ModuleTree, source: LayoutSpec, naming: RankFileNaming) -> None:
        self.tree = tree
        self.files = _ModelFiles(path, tree, source, naming)
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
