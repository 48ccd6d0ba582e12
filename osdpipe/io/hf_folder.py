"""A Hugging Face model folder as ``save_pretrained`` writes it (``config.json`` and safetensors files), and its
weights read back.

Written by :func:`osdpipe.io.safetensors_out.write_safetensors` (one tensor at a time, hashed on the way, sharded
past ``max_shard_size`` with an index); read back by :func:`read_weights`, which parses the format itself (an 8-byte
header length, a JSON header, the data) so that proving an output needs neither ``safetensors`` nor
``transformers`` installed.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from osdpipe.io.digest import file_sha256
from osdpipe.io.formats.base import InputError
from osdpipe.io.remote_input import RemotePath, as_path
from osdpipe.io.safetensors_out import DTYPE_CODES, INDEX_FILE, SINGLE_FILE, TensorSpec, write_safetensors

CONFIG = "config.json"
#: The generation defaults ``save_pretrained`` writes beside ``config.json`` (token ids, sampling settings).
GENERATION_CONFIG = "generation_config.json"
#: The entry of a Megatron save's ``common.pt`` in which osdpipe keeps the Hugging Face folder the save was made of
#: (:func:`record_of`), for the way back (``output.checkpoint=hf``, :func:`config_back`).
RECORD = "hugging_face"
#: The dtypes a folder's weights are written in, as ``config.json`` names them.
DTYPES = ("float32", "bfloat16", "float16")
#: ``model.factory`` of the model a folder's ``config.json`` describes (:func:`model_from_config`).
MODEL_FROM_CONFIG = "osdpipe.io.hf_folder:model_from_config"
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def write_folder(
    directory: Path, config: dict, state: dict[str, torch.Tensor], max_shard_size: int | None = None
) -> dict[str, str]:
    """Write ``config.json`` and ``state`` (HF names -> tensors, in the order given) into the existing ``directory``;
    returns each file's sha256."""
    specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    digests = write_safetensors(directory, specs, lambda spec: state[spec.name], max_shard_size=max_shard_size)
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {**digests, CONFIG: file_sha256(directory / CONFIG)}


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory`` (one file, or the shards its index names).

    Raises:
        InputError: a file is missing, or its header or length is not the format's.
    """
    out: dict[str, torch.Tensor] = {}
    for name in weight_files(directory):
        out.update(_read_file(directory / name))
    return out


def mapped_weights(directory: Path | RemotePath) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``, each a view of its file mapped into memory (private:
    nothing is written back), so that reading a range of one brings only its pages in; a file in object storage,
    memory its readers fetch the ranges of as they read (:mod:`osdpipe.io.fetched_memory`).

    Raises:
        InputError: a file is missing, or its header or length is not the format's.
    """
    out: dict[str, torch.Tensor] = {}
    for name in weight_files(directory):
        path = directory / name
        if not path.is_file():
            raise InputError(f"{path} is missing; the folder's safetensors files are incomplete")
        size = path.stat().st_size
        length, header = _sized_header_of(path)
        storage = _mapped(path, size)
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            begin, end = (8 + length + o for o in entry["data_offsets"])
            if end > size:
                raise InputError(f"{path}: {key} runs past the end of the file (truncated)")
            dtype = _DTYPES[entry["dtype"]]
            flat = torch.empty(0, dtype=dtype)
            if end > begin:
                flat = torch.tensor([], dtype=torch.uint8).set_(storage, begin, (end - begin,)).view(dtype)
            out[key] = flat.reshape(entry["shape"])
    return out


def _mapped(path: Path | RemotePath, size: int) -> torch.UntypedStorage | None:
    """The file's bytes as a storage: mapped privately from a local disk, reserved for a file in object storage."""
    if not size:
        return None
    if isinstance(path, RemotePath):
        from osdpipe.io import fetched_memory
        from osdpipe.io.remote_torchfile import ObjectFetcher

        return fetched_memory.reserve(size, 0, ObjectFetcher(path))
    return torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)


def weights_dtypes(directory: Path) -> set[str]:
    """The dtypes of the tensors in the folder's safetensors files (as torch names them), from their headers alone."""
    return {
        str(_DTYPES[entry["dtype"]]).removeprefix("torch.")
        for name in weight_files(directory)
        for key, entry in header_of(directory / name).items()
        if key != "__metadata__"
    }


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds safetensors weights as ``save_pretrained`` writes them: one file, or an index."""
    return (directory / SINGLE_FILE).is_file() or (directory / INDEX_FILE).is_file()


def weight_files(directory: Path) -> list[str]:
    """The names of the folder's safetensors files: the one file, or the shards its index names.

    Raises:
        InputError: a damaged index, or neither (a ``pytorch_model.bin`` folder), naming what the folder holds.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError):
            raise InputError(f"{index} is damaged (no weight_map); copy the model's files again") from None
    if not (directory / SINGLE_FILE).is_file():
        held = sorted(p.name for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []
        raise InputError(f"{directory} holds no {SINGLE_FILE} or {INDEX_FILE} (it holds "
                         f"{', '.join(held[:5]) or 'no file'}); save the model with "
                         "save_pretrained(safe_serialization=True)")
    return [SINGLE_FILE]


def header_of(path: Path | RemotePath) -> dict:
    """The JSON header of the safetensors file ``path`` (each tensor's dtype, shape and byte range), read alone (in
    object storage: its first bytes, by range)."""
    return _sized_header_of(path)[1]


def _sized_header_of(path: Path | RemotePath) -> tuple[int, dict]:
    """The length of the safetensors file's header and the header (:func:`header_of`): its data begins after."""
    if isinstance(path, RemotePath):
        length = _header_length(path, path.read_range(0, 8))
        return length, _parsed_header(path, path.read_range(8, length))
    with open(path, "rb") as f:
        length = _header_length(path, f.read(8))
        return length, _parsed_header(path, f.read(length))


def _header_length(path: Path, first: bytes) -> int:
    """The header's length, from a safetensors file's ``first`` 8 bytes (little-endian)."""
    if len(first) < 8:
        raise InputError(f"{path} is shorter than a safetensors header")
    return struct.unpack("<Q", first)[0]


def _parsed_header(path: Path, text: bytes) -> dict:
    try:
        header = json.loads(text)
    except ValueError:
        raise InputError(f"{path}: its header is not JSON; it is not a safetensors file") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: its header is no JSON object; it is not a safetensors file")
    return header


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise InputError(f"{path} is missing; the folder's safetensors files are incomplete")
    data = bytearray(path.read_bytes())  # writable: each tensor a view of it, no copy of its own
    length = _header_length(path, bytes(data[:8]))
    header = _parsed_header(path, data[8 : 8 + length])
    start, out = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if start + end > len(data):
            raise InputError(f"{path}: {name} runs past the end of the file (truncated)")
        dtype = _DTYPES[entry["dtype"]]
        count = (end - begin) // dtype.itemsize
        flat = torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin) if count else torch.empty(
            0, dtype=dtype)
        out[name] = flat.reshape(entry["shape"])
    return out


def read_config(directory: str | Path) -> dict:
    """The ``config.json`` beside a Hugging Face model's weights (an HF Trainer's ``checkpoint-<N>`` has one).

    Raises:
        InputError: there is none, or it is no JSON object.
    """
    path = as_path(directory) / CONFIG
    if not path.is_file():
        raise InputError(f"{directory} holds no {CONFIG}: the model's dimensions come from it (the HF Trainer saves "
                         "one beside its weights); copy the model's config.json there")
    try:
        config = json.loads(path.read_text())
    except ValueError:
        raise InputError(f"{path} is damaged (not JSON); copy the model's config.json again") from None
    if not isinstance(config, dict):
        raise InputError(f"{path} holds no JSON object; it is not a model's config.json")
    return config


def config_builds_a_model(directory: str | Path) -> bool:
    """Whether ``directory`` holds a ``config.json`` that :func:`model_from_config` builds a model of (a Llama, Qwen2,
    Qwen3 or GPT-2 a Megatron GPT expresses): where it does, a checkpoint beside it needs no ``model.factory``."""
    from osdpipe.layout import megatron_hf

    try:
        megatron_hf.megatron_args(read_config(directory), 1, 1, 1)
    except (InputError, ValueError, KeyError, TypeError):
        return False
    return True


def model_from_config(path: str, dtype: str = "float32") -> torch.nn.Module:
    """A module with the parameters of the Hugging Face model whose ``config.json`` is in ``path`` (a
    ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or ``GPT2LMHeadModel``: the family of
    :mod:`osdpipe.layout.megatron_hf` it is): each under its Hugging Face name and shape, in ``dtype`` (by default
    fp32: a training checkpoint's masters; a model folder's: its weights' own), in
    transformers' ``named_parameters()`` order (:func:`osdpipe.layout.megatron_hf.hf_shapes` of the GPT the config
    is: the order a PyTorch optimizer's state follows); no ``forward``, and no transformers needed. Where the config
    ties the output layer to the word embedding, ``lm_head.weight`` is the embedding's parameter, as transformers ties
    them (``named_parameters()`` yields it once). What ``model.factory`` is where a Hugging Face checkpoint converts to
    Megatron and the user names no model.

    Raises:
        ValueError: a config a Megatron GPT cannot express, in one line.
    """
    from osdpipe.io.formats.megatron import gpt_of
    from osdpipe.layout import megatron_hf

    config = read_config(path)
    try:  # the GPT at TP1 PP1, which any dimensions fit: its shapes are the model's
        gpt = gpt_of(megatron_hf.megatron_args(config, 1, 1, 1))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    root = torch.nn.Module()
    for name, shape in megatron_hf.hf_shapes(gpt, int(config["vocab_size"])).items():
        _place(root, name, torch.nn.Parameter(torch.empty(shape, dtype=getattr(torch, dtype))))
    if (tied := megatron_hf.tied_names(gpt)) is not None:  # one parameter under both names, as transformers ties them
        embedding, output = tied
        _place(root, output, root.get_parameter(embedding))
    root.fsdp_units = _decoder_layers(name for name, _ in root.named_parameters())
    return root


def _decoder_layers(names: Iterable[str]) -> tuple[str, ...]:
    """The decoder layers' module names (``model.layers.<i>``, GPT-2's ``transformer.h.<i>``), in order: the modules
    transformers' ``_no_split_modules`` names for these families, which FSDP1 jobs wrap as units (accelerate's, veRL's,
    the HF Trainer's transformer-based auto wrap). The one numbered module on each parameter's path."""
    layers: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        if at is not None:
            layers[".".join(parts[: at + 1])] = None
    return tuple(layers)


def _place(root: torch.nn.Module, name: str, parameter: torch.nn.Parameter) -> None:
    """``parameter`` at the dotted ``name`` under ``root``, the modules on its way made as needed."""
    *parents, leaf = name.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, parameter)


def record_of(directory: str | Path, config: dict) -> dict:
    """What a Megatron save made of the Hugging Face folder (or the HF Trainer's checkpoint) ``directory`` keeps of
    it in ``common.pt`` (:data:`RECORD`): its ``config.json`` (``config``, as read) and the text of its
    ``generation_config.json`` where it has one.

    Megatron's ``args`` hold the model's dimensions and nothing else of the folder: without this, the folder made
    back of the save had no token ids (``bos_token_id``, ``eos_token_id``), no ``generation_config.json`` and the
    dtype of the job's masters, not the folder's."""
    record: dict = {"config": config}
    generation = as_path(directory) / GENERATION_CONFIG
    if generation.is_file():
        record["generation_config"] = generation.read_text()
    return record


def recorded_dtype(record: dict | None) -> str | None:
    """The dtype of the weights of the folder ``record`` (:func:`record_of`) was made of, as its ``config.json``
    says it (transformers 5's ``dtype``, 4's ``torch_dtype``); ``None``: no record, or a dtype it does not say."""
    config = (record or {}).get("config") or {}
    said = config.get("dtype") or config.get("torch_dtype")
    return said if said in DTYPES else None


def config_back(record: dict | None, made: dict) -> dict:
    """The ``config.json`` of a folder made of a Megatron save: ``made`` (what the save's ``args`` give) over the
    recorded folder's own (``record``, :func:`record_of`), so that every field ``args`` cannot hold (the token ids,
    the tokenizer's and the generation's settings) is the folder's again; a field ``made`` leaves ``None`` is the
    folder's."""
    recorded = dict((record or {}).get("config") or {})
    return {**recorded, **{k: v for k, v in made.items() if v is not None or k not in recorded}}


def record_problems(record: dict | None, config: dict, directory: Path) -> list[str]:
    """What the folder ``directory`` made of a Megatron save does not hold as it was meant to: ``config`` as its
    ``config.json`` (:func:`config_back`), and, where the save kept the folder it was made of (``record``,
    :func:`record_of`), that folder's ``generation_config.json`` as it was."""
    problems = []
    written, config = json.loads((directory / CONFIG).read_text()), json.loads(json.dumps(config))
    if written != config:
        problems.append(f"{CONFIG}: " + ", ".join(sorted(k for k in {*written, *config}
                                                          if written.get(k) != config.get(k))) + " differ")
    if record and record.get("generation_config") is not None:
        generation = directory / GENERATION_CONFIG
        if not generation.is_file() or generation.read_text() != record["generation_config"]:
            problems.append(f"{GENERATION_CONFIG}: not the one of the folder the save was made of")
    return problems
