"""A DCP directory's top-level entries, with their sizes, read from its ``.metadata`` alone (what both layouts need)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osdpipe.formats.safe_load import read_dcp_metadata


@dataclass(frozen=True)
class Item:
    """One stored item: its path in the saved state dict, whether it is a tensor, and its stored bytes (and a tensor's shape)."""

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
        Item(tuple(paths.get(flat, (flat,))), isinstance(md, TensorStorageMetadata), sizes[flat], tuple(md.size) if isinstance(md, TensorStorageMetadata) else None)
        for flat, md in metadata.state_dict_metadata.items()
    ]


def is_dcp(directory: Path) -> bool:
    return directory.is_dir() and (directory / ".metadata").is_file()
