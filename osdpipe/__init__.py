"""osdpipe: reshard PyTorch optimizer state between distributed training layouts, and prove it right."""

__version__ = "0.1.0"

from osdpipe.api import load_optimizer_state, reshard_optimizer_state  # noqa: E402

__all__ = ["__version__", "load_optimizer_state", "reshard_optimizer_state"]
