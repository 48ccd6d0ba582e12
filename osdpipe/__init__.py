"""osdpipe: reshard PyTorch optimizer state between distributed training layouts, and prove it right.

The Python API is imported on first use, so that ``import osdpipe`` (and the
command's start, see :mod:`osdpipe.entry`) does not import torch.
"""

from typing import Any

__version__ = "0.1.0"

_API = {
    "load_optimizer_state": "osdpipe.api",
    "reshard_optimizer_state": "osdpipe.api",
    "from_rank_local": "osdpipe.kinds.fsdp2",
    "load_rank_local": "osdpipe.loading",
    "to_rank_local": "osdpipe.kinds.fsdp2",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'osdpipe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_API[name]), name)
