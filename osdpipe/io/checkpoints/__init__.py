"""The registry of checkpoint layouts (:mod:`osdpipe.io.checkpoints.base`): the optimizer alone (the default),
torchtitan's, accelerate's, PyTorch's own, DeepSpeed's and veRL's (read, written as PyTorch's), Megatron-LM's, and a
Hugging Face model folder's (its weights alone). Every conversion between them runs through the one stage loop."""

from __future__ import annotations

from pathlib import Path

from osdpipe.core.registry import member

# each registers its layout, in the order recognize() asks them
from osdpipe.io.checkpoints import accelerate, deepspeed, megatron, optimizer, pytorch, torchtitan, verl  # noqa: F401

# isort: split
from osdpipe.io.checkpoints import hf  # noqa: F401  (last: a Trainer's checkpoint-<N> holds a model folder too)
from osdpipe.io.checkpoints.base import LAYOUTS, CheckpointLayout, Entry, WholeCheckpoint
from osdpipe.io.remote_input import RemotePath, as_path

__all__ = ["LAYOUTS", "CheckpointLayout", "Entry", "WholeCheckpoint", "get", "recognize", "recognizing", "written"]


def get(name: str) -> CheckpointLayout:
    """The layout called ``name`` (``checkpoint=``).

    Raises:
        ValueError: naming the layouts there are.
    """
    return member(LAYOUTS, name, "checkpoint layout")


def written(layout: str, output_checkpoint: str | None) -> CheckpointLayout:
    """The layout a conversion of a ``layout`` checkpoint writes: ``output.checkpoint``, else the input's own (a layout
    osdpipe only reads: the one it is written as)."""
    reads = get(layout)
    return get(output_checkpoint or reads.written_as or reads.name)


def recognizing(path: str | Path | RemotePath) -> tuple[CheckpointLayout, Path | RemotePath] | None:
    """The first layout that recognizes the whole checkpoint at ``path``, and the folder it reads: ``path``, or for a
    framework's folder of checkpoints (torchtitan's ``--checkpoint.folder``) its newest, as the framework resumes;
    ``None``: no layout does (an optimizer checkpoint). Nothing is read but what recognizing asks."""
    where = as_path(path)
    for layout in LAYOUTS.values():
        newest = layout.newest_in(str(where)) if layout.whole and where.is_dir() else None
        if newest is not None and layout.recognizes(as_path(newest)):
            return layout, as_path(newest)
        if layout.recognizes(where):
            return layout, where
    return None


def recognize(path: str | Path | RemotePath) -> WholeCheckpoint | None:
    """The whole checkpoint at ``path`` as the first layout that recognizes it reads it (:func:`recognizing`);
    ``None``: no layout does (an optimizer checkpoint). In object storage (a
    :class:`~osdpipe.io.remote_input.RemotePath`) every layout is asked as it is of a local folder: each reads its
    files through :mod:`osdpipe.io.remote_input`."""
    found = recognizing(path)
    return None if found is None else found[0].read(found[1])
