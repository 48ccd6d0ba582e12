"""What a whole checkpoint's rank file is: ``{"model": ..., "optim": ..., ...every other entry}``.

One leaf module (no osdpipe or torch import), so that the writer
(:mod:`osdpipe.io.checkpoints.output`), the loader (:func:`osdpipe.load_rank_local`)
and the per-tensor digests (:mod:`osdpipe.io.digest`) name the two parts alike.
"""

from __future__ import annotations

from typing import Any

#: The keys of a whole checkpoint's rank file that hold the model's and the optimizer's state;
#: every other key is a carried entry.
MODEL_PART, OPTIMIZER_PART = "model", "optim"


def is_whole(loaded: Any) -> bool:
    """Whether a loaded rank file is a whole checkpoint's (model, optimizer and the rest) rather than an optimizer's."""
    return (
        isinstance(loaded, dict)
        and isinstance(loaded.get(MODEL_PART), dict)
        and isinstance(loaded.get(OPTIMIZER_PART), dict)
    )
