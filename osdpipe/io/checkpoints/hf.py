"""A Hugging Face model folder, as ``osdpipe inspect`` names it, ``checkpoint=hf`` reads it and ``output.checkpoint=hf``
writes it.

What ``save_pretrained`` writes (and the Hub serves): ``config.json`` and ``model.safetensors``, or the shards its
``model.safetensors.index.json`` names, beside a tokenizer's files and ``generation_config.json``. It holds the model
alone. Read (its safetensors memory-mapped, the model its ``config.json`` describes), it converts to a Megatron-LM
``release`` save of its weights through the map into Megatron's GPT
(:meth:`osdpipe.io.checkpoints.megatron.Megatron.map_into`). Written (a Megatron save's weights, read through the map
to its Hugging Face model: :meth:`osdpipe.io.checkpoints.megatron.Megatron.model_map`), it is one process's model:
the weights in the model's ``named_parameters()`` order, each made as it is written, the ``config.json`` (and
``generation_config.json``) the source's layout made for it.

It is recognized last, and only without a training run's files beside the weights: the HF Trainer's
``checkpoint-<N>`` holds the same ``config.json`` and safetensors with its optimizer, and is accelerate's layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from osdpipe.io import hf_folder
from osdpipe.io.checkpoints.base import Carrying, CheckpointLayout, Entry, ModelNaming, WholeCheckpoint, register
from osdpipe.io.formats.base import InputError
from osdpipe.io.hf_folder import CONFIG
from osdpipe.io.remote_input import as_path
from osdpipe.io.safetensors_out import INDEX_FILE

if TYPE_CHECKING:  # annotations only: writing imports torch
    import torch

    from osdpipe.layout.tree import ModuleTree

#: Files of a training run beside a model's weights (the HF Trainer's, accelerate's): such a folder is no model folder.
TRAINING_FILES = ("optimizer.pt", "optimizer.bin", "trainer_state.json", "scheduler.pt", "optimizer_0",
                  "pytorch_model_fsdp_0", "pytorch_model_fsdp.bin")
@register
class HuggingFaceFolder(CheckpointLayout):
    """A Hugging Face model folder: ``config.json`` and safetensors, the weights alone."""

    name = "hf"
    looks_like = "a Hugging Face model folder (config.json and model.safetensors, or its shards and their index)"
    whole = True
    input_formats: ClassVar[tuple[str, ...]] = ("safetensors",)
    output_formats: ClassVar[tuple[str, ...]] = ("safetensors",)
    weights_alone = True
    made_as_written = True
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

    def model_from_files(
        self, path: str, written_in: CheckpointLayout | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        """transformers' model of the folder's ``config.json`` (a Llama, Qwen2, Qwen3 or GPT-2:
        :func:`osdpipe.io.hf_folder.model_from_config`) in its weights' dtype; ``None`` for another model's folder."""
        if not hf_folder.config_builds_a_model(path):
            return None
        return hf_folder.MODEL_FROM_CONFIG, {"path": str(path), "dtype": self.weights_dtype(path)}

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> None:
        """None: a model folder holds the weights alone."""
        return None

    def weights_dtype(self, path: str) -> str:
        """The one dtype of the folder's weights: a bf16 folder is a bf16 job's weights.

        Raises:
            InputError: weights of more than one dtype, or of one a GPT's weights are not.
        """
        dtypes = sorted(hf_folder.weights_dtypes(as_path(path)))
        if len(dtypes) != 1 or dtypes[0] not in ("float32", "bfloat16", "float16"):
            raise InputError(f"{path}: weights of dtype {', '.join(dtypes) or 'none'}; a GPT's are one of float32, "
                             "bfloat16 or float16: not supported yet")
        return dtypes[0]

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> Any:
        """The folder's safetensors files, memory-mapped, by the names of the model its ``config.json`` builds."""
        from osdpipe.io.checkpoints.file_weights import FileWeights  # torch: only where a checkpoint is read

        return FileWeights.of_folder(as_path(path), tree)

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """Nothing to carry: the folder is the model (its weights and ``config.json``); its other files are named in
        the report (a tokenizer's, ``generation_config.json``), and the output's layout says what becomes of them."""
        return Carrying(str(path), entries=self.read(as_path(path)).entries, optimizer=False, layout=self.name)

    def settles(self, source: CheckpointLayout, path: str) -> dict[str, Any]:
        """A model folder is one process's model."""
        return {"target.kind": "none", "target.world_size": 1}

    def write(
        self, parts: Any, staging: Path, rank: int, *, world_size: int, tree: ModuleTree, shared: dict[str, Any],
        fmt: Any, target: Any = None, output_config: Any = None,
    ) -> Any:
        """The folder, on rank 0 (it is one process's model): every weight of :func:`weights_of`, in files of at most
        ``output.max_shard_size`` bytes, and the files the source's layout made for it (:func:`made_files`)."""
        from osdpipe.io.formats.base import RankFiles
        from osdpipe.io.safetensors_out import TensorSpec, write_safetensors

        if world_size != 1:
            raise ValueError(f"a Hugging Face folder is one process's model: set target.world_size=1, not {world_size}")
        weights = weights_of(parts.weights, tree)
        specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in weights.items()]
        shard = getattr(output_config, "max_shard_size", None)
        digests = write_safetensors(staging, specs, lambda spec: weights[spec.name], max_shard_size=shard)
        for name, data in made_files(parts.carrying, weights).items():
            (staging / name).write_bytes(data)
            digests[name] = _sha256(data)
        return RankFiles(digests, {}, None)

    def finish(
        self, staging: Path, shared: dict[str, Any], per_rank: list[Any], fmt: Any, carrying: Carrying,
        target: Any = None,
    ) -> dict[str, str]:
        """Nothing: rank 0 wrote the folder whole."""
        return {}

    def differences(
        self, directory: Path, parts: Any, rank: int, *, world_size: int, tree: ModuleTree, fmt: Any,
        opened: dict[str, Any], target: Any = None,
    ) -> list[str]:
        """Each weight of the folder read back that is not the one written, bitwise, and each file the source's layout
        made that is not as made."""
        from osdpipe.core.compare import bits_equal

        weights = weights_of(parts.weights, tree)
        back = hf_folder.read_weights(directory)
        problems = [f"{directory}: {name} is not what was written (bitwise)" for name, want in weights.items()
                    if name not in back or not bits_equal(back[name], want)]
        for name, data in made_files(parts.carrying, weights).items():
            if not (directory / name).is_file() or (directory / name).read_bytes() != data:
                problems.append(f"{directory / name} is not what osdpipe made of {parts.carrying.source}")
        return problems


def weights_of(weights: dict[str, torch.Tensor], tree: ModuleTree) -> dict[str, torch.Tensor]:
    """A rank's whole weights (by canonical name) as a folder holds them: each parameter under its first name, in the
    model's ``state_dict()`` order; a tied weight's other names are left out, as ``save_pretrained`` leaves them."""
    return {name: weights[name] for name in tree.state_names if (p := tree.resolve(name)) is not None
            and p.fqn == name and name in weights}


def made_files(carrying: Carrying, weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """The files the source's layout made for the folder (:attr:`~osdpipe.io.checkpoints.base.Carrying.made`),
    ``config.json`` saying the dtype the weights are written in (transformers 5's ``dtype``, 4's ``torch_dtype``)."""
    out = dict(carrying.made)
    if CONFIG in out and weights:
        config = json.loads(out[CONFIG])
        dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
        config.update({k: dtype for k in ("dtype", "torch_dtype")})
        out[CONFIG] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return out


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


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

