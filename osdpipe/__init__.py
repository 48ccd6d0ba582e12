"""osdpipe: reshard PyTorch optimizer state between distributed training layouts, and prove it right."""

__version__ = "0.1.0"

from osdpipe.api import load_optimizer_state, reshard_optimizer_state  # noqa: E402
from osdpipe.kinds.fsdp2 import from_rank_local, load_rank_local, to_rank_local  # noqa: E402

__all__ = ["__version__", "from_rank_local", "load_optimizer_state", "load_rank_local", "reshard_optimizer_state", "to_rank_local"]
