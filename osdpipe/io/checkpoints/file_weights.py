"""A whole checkpoint's model weights in one ``torch.save`` file of the full state dict
(accelerate's FULL_STATE_DICT ``pytorch_model_fsdp.bin``)."""

from __future__ import annotations

from pathlib import Path

import torch

from osdpipe.io import fetched_memory
from osdpipe.io.formats.base import InputError, describe_value, mapped_range
from osdpipe.io.formats.safe_load import load_torch_file
from osdpipe.io.weights import ModelMeta, model_meta_of, stored_names
from osdpipe.layout.tree import ModuleTree


class FileWeights:
    """The file's full state dict, memory-mapped (read as data nobody vouches for):
    each parameter's weights a range of its mapping.

    Raises:
        InputError: from the constructor, for a file that is damaged or not a model's state dict (name -> tensor).
    """

    def __init__(self, path: Path, tree: ModuleTree) -> None:
        self.path, self.tree = path, tree
        state = load_torch_file(path)
        if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
            raise InputError(
                f"{path} holds no model state dict (names to tensors); is it the model part of the checkpoint?"
            )
        self.state: dict[str, torch.Tensor] = state
        self._names: dict[str, str] | None = None

    @classmethod
    def of_folder(cls, directory: Path, tree: ModuleTree) -> FileWeights:
        """A Hugging Face model folder's weights: its safetensors files, memory-mapped
        (:func:`osdpipe.io.hf_folder.mapped_weights`)."""
        from osdpipe.io import hf_folder

        weights = cls.__new__(cls)
        weights.path, weights.tree, weights._names = directory, tree, None
        weights.state = hf_folder.mapped_weights(directory)
        return weights

    def model_meta(self) -> ModelMeta:
        stored = {name: describe_value(value) for name, value in self.state.items() if self.tree.holds_weights(name)}
        buffers = {
            name: fetched_memory.fetch_all(value).clone()  # a file in object storage: its bytes fetched first
            for name, value in self.state.items()
            if not self.tree.holds_weights(name)
        }
        return model_meta_of(stored, buffers, self.tree, str(self.path))

    def stored_name(self, name: str) -> str | None:
        if self._names is None:
            self._names = stored_names(self.state, self.tree)
        return self._names.get(name)

    def read_weights(self, name: str, start: int, stop: int) -> torch.Tensor:
        return mapped_range(self.state[name], start, stop)
