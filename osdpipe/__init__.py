"""osdpipe: reshard PyTorch optimizer state between distributed training layouts, and prove it right.

The Python API is imported on first use, so that ``import osdpipe`` (and the
command's start, see :mod:`osdpipe.cli.entry`) does not import torch.
"""

from typing import Any

from osdpipe.core.version import __version__

_API = {
    "load_optimizer_state": "osdpipe.api",
    "reshard_optimizer_state": "osdpipe.api",
    "reshard_megatron": "osdpipe.api",
    "from_rank_local": "osdpipe.layout.kinds.fsdp2",
    "load_rank_local": "osdpipe.io.loading",
    "to_rank_local": "osdpipe.layout.kinds.fsdp2",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'osdpipe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_API[name]), name)
