"""The registry of whole-checkpoint layouts (:mod:`osdpipe.checkpoints.base`): torchtitan's and accelerate's."""

from __future__ import annotations

from pathlib import Path

from osdpipe.checkpoints import accelerate, torchtitan  # noqa: F401 - each registers its layout
from osdpipe.checkpoints.base import LAYOUTS, CheckpointLayout, Entry, WholeCheckpoint

__all__ = ["LAYOUTS", "CheckpointLayout", "Entry", "WholeCheckpoint", "recognize"]


def recognize(path: str | Path) -> WholeCheckpoint | None:
    """The whole checkpoint at ``path`` as the first layout that recognizes it reads it; ``None``: no layout does (an optimizer checkpoint)."""
    where = Path(path)
    for layout in LAYOUTS.values():
        if layout.recognizes(where):
            return layout.read(where)
    return None
