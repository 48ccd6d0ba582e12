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
from pathlib import Path

import torch

from osdpipe.io.digest import file_sha256
from osdpipe.io.formats.base import InputError
from osdpipe.io.safetensors_out import DTYPE_CODES, INDEX_FILE, SINGLE_FILE, TensorSpec, write_safetensors

CONFIG = "config.json"
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
    index = directory / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = [SINGLE_FILE]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        out.update(_read_file(directory / name))
    return out


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise InputError(f"{path} is missing; the folder's safetensors files are incomplete")
    data = bytearray(path.read_bytes())  # writable: each tensor a view of it, no copy of its own
    if len(data) < 8:
        raise InputError(f"{path} is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError:
        raise InputError(f"{path}: its header is not JSON; it is not a safetensors file") from None
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
