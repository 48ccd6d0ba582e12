"""A Hugging Face model folder, as ``osdpipe inspect`` names it and ``checkpoint=hf`` reads it.

What ``save_pretrained`` writes (and the Hub serves): ``config.json`` and ``model.safetensors``, or the shards its
``model.safetensors.index.json`` names, beside a tokenizer's files and ``generation_config.json``. It holds the model
alone. It converts by Megatron's own stages to a Megatron-LM ``release`` save of its weights
(:mod:`osdpipe.pipeline.hf_folder_to_megatron`); this layout names its entries and the model its ``config.json``
describes.

It is recognized last, and only without a training run's files beside the weights: the HF Trainer's
``checkpoint-<N>`` holds the same ``config.json`` and safetensors with its optimizer, and is accelerate's layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from osdpipe.io import hf_folder
from osdpipe.io.checkpoints.base import CheckpointLayout, Entry, ModelNaming, WholeCheckpoint, register
from osdpipe.io.formats.base import InputError
from osdpipe.io.hf_folder import CONFIG
from osdpipe.io.safetensors_out import INDEX_FILE

#: Files of a training run beside a model's weights (the HF Trainer's, accelerate's): such a folder is no model folder.
TRAINING_FILES = ("optimizer.pt", "optimizer.bin", "trainer_state.json", "scheduler.pt", "optimizer_0",
                  "pytorch_model_fsdp_0", "pytorch_model_fsdp.bin")
@register
class HuggingFaceFolder(CheckpointLayout):
    """A Hugging Face model folder: ``config.json`` and safetensors, the weights alone."""

    name = "hf"
    looks_like = "a Hugging Face model folder (config.json and model.safetensors, or its shards and their index)"
    whole = True
    input_formats: ClassVar[tuple[str, ...]] = ()
    output_formats: ClassVar[tuple[str, ...]] = ("dcp",)
    target_placeholders: ClassVar[tuple[str, ...]] = ("target.tp_size=T", "target.pp_size=P")

    def recognizes(self, path: Path) -> bool:
        return (
            path.is_dir() and (path / CONFIG).is_file() and hf_folder.has_weights(path)
            and not any((path / name).exists() for name in TRAINING_FILES)
        )

    def model_naming(self, path: Path) -> ModelNaming:
        """No model to name: ``config.json`` gives every dimension."""
        return ModelNaming(())

    def read(self, path: Path) -> WholeCheckpoint:
        """Every file of the folder: the weights (each safetensors file, its tensors counted from its header alone)
        and ``config.json`` are the model; the rest is left out of a conversion. Notes: the model the config
        describes, and that the folder holds no optimizer.

        Raises:
            InputError: no ``config.json``, or a safetensors file that is missing or damaged.
        """
        config = hf_folder.read_config(path)
        weights = hf_folder.weight_files(path)
        entries = []
        for name in weights:
            if not (path / name).is_file():
                raise InputError(f"{path / name} is missing; the folder's safetensors files are incomplete")
            header = hf_folder.header_of(path / name)
            entries.append(Entry(name, "model", name, (path / name).stat().st_size,
                                 len([k for k in header if k != "__metadata__"])))
        for file in sorted(p for p in path.iterdir() if p.is_file() and p.name not in weights):
            entries.append(Entry(file.name, "model" if file.name in (CONFIG, INDEX_FILE) else "other", file.name,
                                 file.stat().st_size))
        return WholeCheckpoint(self.name, str(path), tuple(entries), notes=tuple(_notes(config)))


def kind_of(entry: Entry) -> str:
    """What a conversion does with a folder's entry: ``weights`` (a safetensors file or their index), ``config``
    (``config.json``), ``generation`` (``generation_config.json``) or ``other``."""
    if entry.name == CONFIG:
        return "config"
    if entry.name == hf_folder.GENERATION_CONFIG:
        return "generation"
    return "weights" if entry.part == "model" else "other"


def _notes(config: dict) -> list[str]:
    """The model ``config.json`` describes, and what the folder does not hold."""
    architectures = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
    heads, groups = config.get("num_attention_heads"), config.get("num_key_value_heads") or config.get(
        "num_attention_heads")
    return [
        f"{architectures}: {config.get('num_hidden_layers')} layers, hidden {config.get('hidden_size')}, "
        f"intermediate {config.get('intermediate_size')}, {heads} heads in {groups} key/value heads, vocabulary "
        f"{config.get('vocab_size')}, {config.get('torch_dtype') or config.get('dtype') or 'dtype unsaid'}",
        "the model's weights alone, no optimizer state: it converts to a Megatron-LM release save "
        "(output.checkpoint=megatron), whose optimizer starts fresh",
    ]

