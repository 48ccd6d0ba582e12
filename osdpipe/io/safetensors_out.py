"""Stream a model's full, FQN-keyed weights into safetensors files, one tensor at a time.

osdpipe exports weights as Hugging Face's ``save_pretrained`` does (safetensors
files named and sharded as ``transformers`` names and ``huggingface_hub``
shards them, plus ``model.safetensors.index.json`` when there is more than one
file), but the model may be larger than memory. ``safetensors.torch.save_file``
needs every tensor of a file at once, so this module writes the format itself:
a file's header depends only on names, shapes and dtypes, which are known
before any tensor exists, so the header is written first and each tensor's
bytes are appended as the caller produces it. At most one produced tensor (and
its contiguous CPU copy, when it needs one) is alive in the writer at a time.

The format (https://github.com/huggingface/safetensors, README "Format"):

- 8 bytes: ``N``, the header's length, an unsigned little-endian 64-bit integer;
- ``N`` bytes: the header, UTF-8 JSON starting with ``{``, padded at the end
  with spaces (0x20); the reference writer pads ``N`` to a multiple of 8 so that
  the data starts 8-byte aligned, and so does this one;
- the data: every tensor's bytes, little-endian and row-major (C order), one
  after the other with no gaps, each at the ``data_offsets`` ``[begin, end)``
  the header gives it, counted from the start of the data.

The header maps each tensor name to ``{"dtype", "shape", "data_offsets"}``, and
the optional key ``__metadata__`` to a map of strings to strings.

Within a file, tensors go in order of element size, largest first (stable:
the caller's order among equal sizes), as the reference writer orders them by
dtype size: the data starts 8-byte aligned, so every tensor then starts at a
multiple of its own element size, which readers that map a file and view its
bytes in place need. The writer asks for the tensors in that order, file by
file (:func:`file_order`).
"""

from __future__ import annotations

import json
import math
import operator
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from osdpipe.io import torchfile
from osdpipe.io.digest import HashingFile

SINGLE_FILE = "model.safetensors"
"""The file name of an unsharded export, as ``transformers`` writes it (``SAFE_WEIGHTS_NAME``)."""

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded export, as ``transformers`` writes it (``SAFE_WEIGHTS_INDEX_NAME``)."""

DEFAULT_METADATA: Mapping[str, str] = {"format": "pt"}
"""What ``save_pretrained`` puts in every file's ``__metadata__``; ``transformers``' loader checks it."""

MAX_HEADER_SIZE = 100_000_000
"""The largest header the reference reader accepts (``MAX_HEADER_SIZE`` in safetensors' ``tensor.rs``)."""

_METADATA_KEY = "__metadata__"


def _dtype_codes() -> dict[torch.dtype, str]:
    """The safetensors dtype code of every torch dtype this writer stores.

    The codes are those of safetensors' ``Dtype`` enum, matched to torch dtypes as
    ``safetensors.torch`` matches them. Dtypes that only newer torch builds have
    (the float8 family, unsigned 16/32/64-bit) are looked up by name so the module
    imports on any supported torch. ``float4_e2m1fn_x2`` is left out on purpose:
    safetensors stores it as ``F4`` with a shape counted in 4-bit elements, not in
    the torch tensor's bytes, which a plain byte copy does not reproduce.
    """
    codes: dict[torch.dtype, str] = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.complex64: "C64",
    }
    optional = {
        "uint64": "U64",
        "uint32": "U32",
        "uint16": "U16",
        "float8_e4m3fn": "F8_E4M3",
        "float8_e5m2": "F8_E5M2",
        "float8_e4m3fnuz": "F8_E4M3FNUZ",
        "float8_e5m2fnuz": "F8_E5M2FNUZ",
        "float8_e8m0fnu": "F8_E8M0",
    }
    for attribute, code in optional.items():
        dtype = getattr(torch, attribute, None)
        if isinstance(dtype, torch.dtype):
            codes[dtype] = code
    return codes


DTYPE_CODES: Mapping[torch.dtype, str] = _dtype_codes()
"""torch dtype -> safetensors dtype code, for every dtype :func:`write_safetensors` accepts."""


@dataclass(frozen=True)
class TensorSpec:
    """What a file's header says of one tensor, known before the tensor is produced.

    Attributes:
        name: The fully qualified name the file stores the tensor under
            (``model.layers.0.mlp.up_proj.weight``), as ``state_dict()`` keys it.
        shape: The tensor's shape; ``()`` for a 0-dim tensor.
        dtype: The tensor's dtype, one of :data:`DTYPE_CODES`.

    Raises:
        ValueError: A dimension is negative or not an integer, or the dtype has no
            safetensors code; raised at construction so that a bad spec fails
            before any file is opened.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        # A torch.Size, a list or numpy integers would all work as a shape; one
        # canonical form keeps specs comparable and the header's JSON plain ints.
        try:
            shape = tuple(operator.index(d) for d in self.shape)
        except TypeError:
            raise ValueError(f"tensor {self.name!r}: shape {self.shape!r} must be a sequence of integers") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {self.name!r}: shape {shape} has a negative dimension")
        object.__setattr__(self, "shape", shape)
        if self.dtype not in DTYPE_CODES:
            supported = ", ".join(str(d) for d in DTYPE_CODES)
            raise ValueError(
                f"tensor {self.name!r}: dtype {self.dtype} has no safetensors code (supported: {supported})"
            )

    @property
    def nbytes(self) -> int:
        """The tensor's size in the file: elements times element size (0 for a zero-element tensor)."""
        return math.prod(self.shape) * self.dtype.itemsize


def shard_plan(specs: Sequence[TensorSpec], max_shard_size: int | None) -> list[list[TensorSpec]]:
    """Group tensors into files the way ``huggingface_hub`` splits a state dict.

    The rule is ``split_state_dict_into_shards_factory``'s (which
    ``save_pretrained`` uses through ``split_torch_state_dict_into_shards``), so an
    osdpipe export has the files a ``save_pretrained`` of the same ordered state
    dict would have: greedy, in the given order, with no attempt to fill shards
    evenly; a tensor that would push the current shard past ``max_shard_size``
    starts a new shard; a tensor larger than ``max_shard_size`` on its own gets a
    shard of its own. As in ``huggingface_hub``, that oversized shard is placed
    *before* the shard being filled, which stays open for the tensors after it:
    sizes ``[2, 20, 3]`` with a limit of 10 give ``[[20], [2, 3]]``, not
    ``[[2], [20], [3]]``. So a shard's tensors keep their relative order but need
    not be consecutive in ``specs`` (:func:`write_safetensors` copes).

    Sizes are the bytes each tensor takes in the file (:attr:`TensorSpec.nbytes`);
    headers are not counted, as ``huggingface_hub`` does not count them.

    Args:
        specs: The tensors, in the order they will be produced.
        max_shard_size: The most tensor bytes in one file (a file holding a single
            larger tensor excepted), or ``None`` for everything in one file.

    Returns:
        The shards, each a list of specs; always at least one, so that an empty
        ``specs`` still gives one (empty) ``model.safetensors``.

    Raises:
        ValueError: ``max_shard_size`` is not positive.
    """
    if max_shard_size is None:
        return [list(specs)]
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive or None, not {max_shard_size}")
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_size = 0
    for spec in specs:
        size = spec.nbytes
        if size > max_shard_size:
            shards.append([spec])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)  # never empty here: an empty shard admits any size up to the limit
            current = []
            current_size = 0
        current.append(spec)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of ``count`` shards, as ``transformers``' ``save_pretrained`` names them.

    Loaders look for exactly these names (``model.safetensors``, or the index and
    the files it lists), so they are fixed rather than configurable.

    Args:
        count: The number of shards, at least 1.

    Returns:
        ``['model.safetensors']`` for one shard, else
        ``['model-00001-of-0000N.safetensors', ...]`` (numbers padded to 5 digits).

    Raises:
        ValueError: ``count`` is less than 1.
    """
    if count < 1:
        raise ValueError(f"a safetensors export has at least one file, not {count}")
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def file_order(shard: Sequence[TensorSpec]) -> list[TensorSpec]:
    """A file's tensors in the order their bytes follow the header:
    element size descending, the given order among equals.

    The data section starts 8-byte aligned and element sizes are powers of two
    up to 8, so in this order every tensor starts at a multiple of its own
    element size, whatever the sizes of the tensors before it.
    """
    return sorted(shard, key=lambda spec: -spec.dtype.itemsize)


def header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """The first bytes of a safetensors file holding ``specs``: length prefix and padded JSON header.

    Computed from the specs alone, so it can be written before any tensor exists.
    Keys come in a fixed order (``__metadata__`` first, then the tensors in spec
    order) and the JSON is compact, as the reference writer's ``serde_json``
    writes it, so the same input always gives the same bytes.

    Args:
        specs: The file's tensors, in the order their bytes follow the header.
        metadata: The file's ``__metadata__``.

    Returns:
        8 bytes of little-endian length, then the header padded with spaces to a
        multiple of 8 bytes, so that the data section starts 8-byte aligned.

    Raises:
        ValueError: The header would be larger than the reference reader accepts.
    """
    header: dict[str, Any] = {_METADATA_KEY: dict(metadata)}
    offset = 0
    for spec in specs:
        end = offset + spec.nbytes
        header[spec.name] = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_SIZE:
        raise ValueError(
            f"a safetensors header of {len(text)} bytes is more than readers accept ({MAX_HEADER_SIZE});"
            " split the export into more shards (max_shard_size)"
        )
    return struct.pack("<Q", len(text)) + text


def _check_specs(specs: Sequence[TensorSpec]) -> None:
    """Refuse names the format cannot store, before any file is opened."""
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"expected a TensorSpec, got {type(spec).__name__}: {spec!r}")
        if spec.name == _METADATA_KEY:
            raise ValueError(f"{_METADATA_KEY!r} is reserved by the safetensors format and cannot name a tensor")
        if spec.name in seen:
            raise ValueError(
                f"tensor {spec.name!r} is listed twice; safetensors forbids duplicate names"
                " (pass each stored tensor once: tied weights are the caller's to resolve)"
            )
        try:
            spec.name.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"tensor name {spec.name!r} is not valid UTF-8 text: {error}") from None
        seen.add(spec.name)


def _check_metadata(metadata: Mapping[str, str]) -> None:
    """The format allows only strings in ``__metadata__``; fail before writing rather than write an unreadable file."""
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"safetensors metadata maps strings to strings; got {key!r}: {value!r}")


def _write_tensor(out: HashingFile, spec: TensorSpec, file_name: str, value: Any) -> int:
    """Check one produced tensor against its spec and append its bytes; return how many were written.

    Every reference to the tensor (and its contiguous copy) lives in this frame
    only, so it is released when the function returns: the caller's loop must not
    keep the produced tensor in a variable of its own.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"tensor {spec.name!r} (file {file_name}): produce() returned {type(value).__name__}, not a tensor"
        )
    if tuple(value.shape) != spec.shape or value.dtype != spec.dtype:
        raise ValueError(
            f"tensor {spec.name!r} (file {file_name}): produced shape {tuple(value.shape)} dtype {value.dtype},"
            f" but the header written for it says shape {spec.shape} dtype {spec.dtype}"
        )
    if value.layout != torch.strided:
        raise ValueError(
            f"tensor {spec.name!r} (file {file_name}): layout {value.layout} is not dense; "
            "safetensors stores dense tensors"
        )
    windows = torchfile.windows_of(value)
    if windows is not None:  # made as it is written (osdpipe.run.streamed_output): its bytes a window at a time
        written = 0
        for window in windows:
            out.write(window)
            written += len(window)
        return written
    # contiguous() alone would keep a lazy conjugate or negative view's bit and
    # write the un-negated bytes; resolve them first (both are no-ops otherwise).
    value = value.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    data = value.reshape(-1).view(torch.uint8).numpy()
    out.write(data)
    return data.nbytes


class _ShardFile:
    """One safetensors file being written: its header is written on opening, its tensors appended after."""

    def __init__(self, stack: ExitStack, path: Path, header: bytes, expected_size: int) -> None:
        # Registered with the caller's stack at once, so a failure at any later
        # point closes the file (leaving it short, which readers reject).
        self.raw = stack.enter_context(open(path, "xb"))
        self.path = path
        self.out = HashingFile(self.raw)
        self.expected_size = expected_size
        self.out.write(header)
        self.size = len(header)

    def finish(self) -> str:
        """Close the file (a flush error raises here, before the digest is reported) and return its sha256."""
        if self.size != self.expected_size:  # cannot happen once every tensor matched its spec
            raise RuntimeError(f"{self.path.name}: wrote {self.size} bytes, the header promised {self.expected_size}")
        self.raw.close()
        return self.out.sha256.hexdigest()


def write_safetensors(
    directory: Path,
    specs: Sequence[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    *,
    max_shard_size: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Write every tensor, produced one at a time by ``produce(spec)``
    (file by file, in :func:`file_order`), into ``directory``.

    The export is what ``save_pretrained(safe_serialization=True)`` writes for
    the same ordered state dict: ``model.safetensors``, or shards named by
    :func:`shard_names` and grouped by :func:`shard_plan` plus
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
    "weight_map": {name: file}}``, keys sorted, indent 2, as ``transformers``
    writes it). Shards are planned in the order of ``specs``; within a file the
    tensors go in :func:`file_order`, so each is aligned to its element size.

    Memory: every file's header is computed from the specs before any tensor is
    produced and written when the file is opened; then each tensor is produced,
    checked, written and dropped before the next one is asked for, so the writer
    holds at most one produced tensor (plus its contiguous CPU copy, for a
    non-contiguous or non-CPU tensor). One file is open at a time; nothing is
    buffered beyond its own write buffer.

    Tied weights are the caller's business: pass each stored tensor once, under
    the name it should be stored under; a name listed twice is refused, and two
    names whose tensors share memory are written twice (safetensors has no
    aliasing), as ``save_pretrained`` would after untying them.

    Files: the names are fixed, created with ``open(..., "xb")`` (an existing
    file is an error, never overwritten), not fsynced and not renamed: the caller
    stages ``directory`` (which must exist) and commits it. A failure raises; it
    may leave partly written shards, which the format's length checks reject,
    and never leaves an index: the index is written only after every shard is
    complete, so no file claims an export is complete when it is not.

    Output is byte-identical for identical input: no timestamps, compact header
    JSON with ``__metadata__`` first and tensors in file order.

    Args:
        directory: An existing directory to write the files into.
        specs: Name, shape and dtype of every tensor, in the order shards are planned in.
        produce: Returns the tensor for a spec: any device, any strides; its shape
            and dtype must equal the spec's. Called exactly once per spec, file
            by file, in each file's :func:`file_order`.
        max_shard_size: The most tensor bytes per file (``huggingface_hub``'s
            rule, decimal bytes as given), or ``None`` for a single file.
        metadata: Each file's ``__metadata__``; ``None`` means ``{"format": "pt"}``,
            which ``transformers``' loader checks for.

    Returns:
        ``{file name: sha256 hex}`` of every file written, shards in order, then
        the index when there is one; digests are taken from the bytes on their
        way to disk, without reading the files back.

    Raises:
        ValueError: A produced tensor's shape or dtype differs from its spec (the
            message names the tensor, its file and both), a name is listed twice
            or reserved, or ``max_shard_size`` is not positive.
        TypeError: ``produce`` returned something other than a tensor, or the
            metadata is not strings to strings.
        FileExistsError: A file to be written already exists.
        NotImplementedError: The host is big-endian (the format is little-endian
            and no byte swapping is done).
    """
    if sys.byteorder != "little":
        raise NotImplementedError(
            "safetensors data is little-endian; writing it from a big-endian host is not supported"
        )
    directory = Path(directory)
    specs = list(specs)
    _check_specs(specs)
    file_metadata = dict(DEFAULT_METADATA if metadata is None else metadata)
    _check_metadata(file_metadata)

    shards = [file_order(shard) for shard in shard_plan(specs, max_shard_size)]
    names = shard_names(len(shards))
    digests: dict[str, str] = {}
    for name, shard in zip(names, shards):
        header = header_bytes(shard, file_metadata)
        # on any error the file is closed (short, which readers reject) and the error propagates
        with ExitStack() as stack:
            shard_file = _ShardFile(stack, directory / name, header, len(header) + sum(spec.nbytes for spec in shard))
            for spec in shard:
                # produce() goes straight into _write_tensor, so no variable here keeps the tensor alive.
                shard_file.size += _write_tensor(shard_file.out, spec, name, produce(spec))
            digests[name] = shard_file.finish()
    shard_of = {spec.name: name for name, shard in zip(names, shards) for spec in shard}

    if len(shards) > 1:
        index_doc = {
            "metadata": {"total_size": sum(spec.nbytes for spec in specs)},
            "weight_map": {spec.name: shard_of[spec.name] for spec in specs},
        }
        text = (json.dumps(index_doc, indent=2, sort_keys=True) + "\n").encode("utf-8")
        with open(directory / INDEX_FILE, "xb") as raw:
            out = HashingFile(raw)
            out.write(text)
        digests[INDEX_FILE] = out.sha256.hexdigest()

    ordered = {name: digests[name] for name in names}
    if INDEX_FILE in digests:
        ordered[INDEX_FILE] = digests[INDEX_FILE]
    return ordered
