"""osdpipe: reshard PyTorch optimizer state between distributed training layouts, and prove it right."""

__version__ = "0.1.0"
