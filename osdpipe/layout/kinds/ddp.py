"""``ddp``: ``DistributedDataParallel``: every rank holds every parameter whole, and the same optimizer state.

The optimizer sees the module's own parameters, so its state is what the
unwrapped model's optimizer holds, on every rank: param-ID keyed, full
tensors. A DDP job saves it once (``torch.save(optim.state_dict())`` on rank
0, a ``plain`` file) or per rank (``rank_local``, all files alike). DDP's
``module.`` prefix in a checkpoint's FQNs is mapped by the module tree
(:meth:`osdpipe.layout.tree.ModuleTree.resolve`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from osdpipe.layout.kinds.base import LayoutKind, compute_device, register
from osdpipe.layout.kinds.none import NoWrapper
from osdpipe.layout.ranges import LayoutSpec, LocalTensor, full_layout
from osdpipe.layout.tree import ModuleTree


@register
class DDP(LayoutKind):
    name = "ddp"
    state_dict_types = ("full", "local")
    replicated = True

    def rank_layout(self, tree: ModuleTree, spec: LayoutSpec, rank: int) -> tuple[LocalTensor, ...]:
        return full_layout(tree)

    def saved_format(self, state_dict_type: str) -> str:
        return "plain" if state_dict_type == "full" else "rank_local"

    def wrap(self, model: nn.Module, spec: LayoutSpec) -> nn.Module:
        device = compute_device()
        return DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)

    def to_load(self, model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> dict[str, Any]:
        """What the unwrapped model's optimizer loads (DDP adds only the ``module.`` prefix to names)."""
        return NoWrapper().to_load(model.module, optim, full_osd)

    def full_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        return NoWrapper().full_state(model, optim)

    def save(self, model: nn.Module, optim: torch.optim.Optimizer, path: Path, state_dict_type: str, key: str) -> None:
        """full: rank 0's ``optim.state_dict()`` (a ``plain`` file); local: every rank's."""
        if state_dict_type == "local":
            path.mkdir(exist_ok=True)
            torch.save(optim.state_dict(), path / f"rank_{dist.get_rank()}.pt")
        elif dist.get_rank() == 0:
            torch.save(optim.state_dict(), path)
