"""A DCP directory's entries, with their sizes, read from its ``.metadata`` alone,
and which of them a layout carries over (what the DCP layouts share)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osdpipe.io.formats.safe_load import read_dcp_metadata


@dataclass(frozen=True)
class Item:
    """One stored item: its path in the saved state dict,
    whether it is a tensor, and its stored bytes (and a tensor's shape)."""

    path: tuple[Any, ...]
    tensor: bool
    size: int
    shape: tuple[int, ...] | None = None


def dcp_items(directory: Path) -> list[Item]:
    """Every item of the DCP checkpoint in ``directory``, in the metadata's order.

    Raises:
        InputError: the ``.metadata`` is missing or damaged.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # DCP: only where a DCP directory is read

    metadata = read_dcp_metadata(directory / ".metadata")
    sizes: dict[str, int] = defaultdict(int)
    for index, info in metadata.storage_data.items():
        sizes[index.fqn] += int(getattr(info, "length", 0) or 0)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return [
        Item(
            tuple(paths.get(flat, (flat,))),
            isinstance(md, TensorStorageMetadata),
            sizes[flat],
            tuple(md.size) if isinstance(md, TensorStorageMetadata) else None,
        )
        for flat, md in metadata.state_dict_metadata.items()
    ]


def is_dcp(directory: Path) -> bool:
    return directory.is_dir() and (directory / ".metadata").is_file()


def carried_items(
    checkpoint: Any, taken: set[str], skipped_tops: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[Any, ...], dict[str, Any]]:
    """A DCP checkpoint's items that are none of ``taken`` (the model's flat keys) and under none of ``skipped_tops``
    (the optimizer's): their flat keys, the paths they were saved under, and each tensor item's shape and dtype name.
    What a layout carries over as stored."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # DCP: only where a DCP checkpoint is read

    items = tuple(flat for flat, p in checkpoint.paths.items() if flat not in taken and p[0] not in skipped_tops)
    described = {flat: checkpoint.metadata.state_dict_metadata[flat] for flat in items}
    tensors = {
        flat: (tuple(md.size), str(md.properties.dtype).removeprefix("torch."))
        for flat, md in described.items()
        if isinstance(md, TensorStorageMetadata)
    }
    return items, tuple(checkpoint.metadata.planner_data[flat] for flat in items), tensors
