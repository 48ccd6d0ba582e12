"""A Hugging Face model folder's weights: safetensors files, as ``save_pretrained`` writes them.

The format of ``output.checkpoint=hf`` (:class:`osdpipe.io.checkpoints.hf.HuggingFaceFolder`): a folder of one
process's model, its weights alone, so its files hold no optimizer state to read or write here; the checkpoint layout
writes them (:func:`osdpipe.io.safetensors_out.write_safetensors`), each tensor made as it is written under
``runtime.memory_budget``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from osdpipe.io.formats.base import Format, InputError
from osdpipe.layout.tree import ModuleTree

#: The folder's ``config.json`` (:data:`osdpipe.io.hf_folder.CONFIG`, which imports the formats).
CONFIG = "config.json"


class Safetensors(Format):
    """A model folder's safetensors files: every rank's job loads the folder (``from_pretrained``)."""

    name = "safetensors"
    keyed_by_id = False
    directory = True
    looks_like = "a Hugging Face model folder (config.json and model.safetensors, or its shards and their index)"
    made_as_written = True
    weights_alone = True
    generated_name = "model"

    def output_path(self, directory: Path, rank: int) -> Path:
        return directory

    def writes(self, rank: int) -> bool:
        """The folder is one process's model: rank 0 writes it."""
        return rank == 0

    def found_in(self, directory: Path) -> bool:
        return (directory / CONFIG).is_file()

    def open(self, path: str, key: str, *, tree: ModuleTree, source: Any, id_groups: Any) -> Any:
        raise InputError(f"{path}: a Hugging Face model folder holds a model's weights, no optimizer state; read it as "
                         "a whole checkpoint (checkpoint=hf)")

    def write(
        self, result: dict[str, Any], staging: Path, rank: int, *, key: str, tree: ModuleTree, world_size: int,
        shared: dict[str, Any],
    ) -> Any:
        raise ValueError("output.format=safetensors holds a model's weights: write a whole checkpoint into it "
                         "(output.checkpoint=hf)")
