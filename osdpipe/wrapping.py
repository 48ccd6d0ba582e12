"""Apply a layout's wrapping to a real model: FSDP1, or none.

Real FSDP is both the way a generated source checkpoint is trained and the
oracle that verify and the tests hold osdpipe's own layout math against.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from osdpipe.layout import LayoutSpec, wrapped_modules
from osdpipe.tree import describe


def compute_device() -> torch.device:
    """The device FSDP computes on: this rank's GPU when CUDA is present, else the CPU."""
    if torch.cuda.is_available():  # GPU path: one device per local rank
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap(model: nn.Module, spec: LayoutSpec) -> nn.Module:
    """Wrap ``model`` as ``spec`` says (inside an initialized process group for FSDP1).

    Units are the modules whose class name or FQN is in ``spec.wrap``, nested as
    FSDP1's auto-wrapping nests them; with ``wrap_root=False`` the top-most
    units are wrapped where they stand and the root stays a plain module.
    """
    if spec.kind == "none":
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    units = set(wrapped_modules(describe(model), spec))
    unit_ids = {id(m) for name, m in model.named_modules() if name in units}

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else id(module) in unit_ids

    kwargs = dict(
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy[spec.sharding_strategy],
        use_orig_params=spec.use_orig_params,
        device_id=compute_device(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP1 is deprecated upstream, and it is what users have
        if spec.wrap_root:
            return FSDP(model, **kwargs)
        tops = [n for n in units if not any(n.startswith(u + ".") for u in units)]
        for name in tops:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, FSDP(parent.get_submodule(child), **kwargs))
        return model
