"""A whole checkpoint's model weights in a DCP checkpoint
(torchtitan's step folder, accelerate's ``pytorch_model_fsdp_0/``)."""

from __future__ import annotations

import torch

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.dcp_reader import DcpCheckpoint
from osdpipe.io.weights import ModelMeta, model_meta_of, stored_names
from osdpipe.layout.tree import ModuleTree


class DcpWeights:
    """A whole checkpoint's model weights in a DCP checkpoint:
    one tensor item per parameter and buffer, at the top level or under ``key``.

    torchtitan (v0.2 and later) saves ``get_model_state_dict`` at the top
    level, beside its own entries; v0.1 and accelerate save it under
    ``model``. Read as :class:`osdpipe.io.weights.WholeReader` asks: the
    weights described, the buffers read whole (no layout cuts them).
    """

    def __init__(self, checkpoint: DcpCheckpoint, key: str | None, tree: ModuleTree) -> None:
        self.checkpoint, self.key, self.tree = checkpoint, key, tree
        self._names: dict[str, str] | None = None
        #: Stored name -> flat key of every item of the model part. At the top level, the items the model has as a
        #: parameter or a buffer (a user's own top-level entry is not the model's); under a key, every item there.
        self.items: dict[str, str] = {}
        for flat, path in checkpoint.paths.items():
            if key is None and len(path) == 1 and (
                tree.holds_weights(str(path[0])) or tree.resolve_buffer(str(path[0])) is not None
            ):
                self.items[str(path[0])] = flat
            elif key is not None and len(path) == 2 and path[0] == key:
                self.items[str(path[1])] = flat
        if not self.items:
            where = "at the top level" if key is None else f"under {key!r}"
            raise InputError(
                f"DCP checkpoint {checkpoint.path} holds no model weights {where} (it has {checkpoint.tops()}); "
                "is it a whole training checkpoint?"
            )

    def model_meta(self) -> ModelMeta:
        stored = {name: self.checkpoint.ref(flat) for name, flat in self.items.items() if self.tree.holds_weights(name)}
        buffers = {
            name: self.checkpoint.read_item(flat)
            for name, flat in self.items.items()
            if not self.tree.holds_weights(name)
        }
        return model_meta_of(stored, buffers, self.tree, self.checkpoint.path)

    def stored_name(self, name: str) -> str | None:
        if self._names is None:
            self._names = stored_names(self.items, self.tree)
        return self._names.get(name)

    def read_weights(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.checkpoint.read_range(self.items[name], start, stop)
