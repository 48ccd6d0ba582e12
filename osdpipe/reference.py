"""PyTorch's own answer, for verify and the tests: real FSDP models and optimizers of the target.

Nothing here is used to *produce* a conversion; it is what conversions are
checked against.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from osdpipe.config import RunSpec
from osdpipe.layout import LayoutSpec, rank_layout
from osdpipe.models import build_model, example_input
from osdpipe.optim import build_optimizer
from osdpipe.tree import ModuleTree
from osdpipe.wrapping import wrap


def live_target(spec: RunSpec, layout_spec: LayoutSpec, tree: ModuleTree, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A real, wrapped model and its optimizer, as the job resuming on ``layout_spec`` builds them."""
    model = wrap(build_model(spec.model.factory, spec.model.kwargs, seed=spec.model.seed), layout_spec)
    return model, build_optimizer(spec.optim, model, rank_layout(tree, layout_spec, rank))


def train_step(spec: RunSpec, model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One forward, backward and optimizer step on a deterministic batch (the same on every rank)."""
    generator = torch.Generator().manual_seed(spec.generate.seed * 1000 + step)
    batch = example_input(model, spec.generate.batch_size, generator, spec.model.input_shape)
    optim.zero_grad(set_to_none=True)
    out = model(batch.to(next(model.parameters()).device))
    out.float().pow(2).mean().backward()
    optim.step()


def fsdp_to_load(model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> dict[str, Any]:
    """PyTorch's conversion of a full FQN-keyed state into this rank's loadable state."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP.optim_state_dict_to_load(model, optim, full_osd)


def pytorch_to_load(kind: str, model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> dict[str, Any]:
    """PyTorch's param-ID keyed state for this rank: FSDP1's conversion, or for an unwrapped model its rekeying."""
    if kind == "fsdp1":
        return fsdp_to_load(model, optim, full_osd)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = full_osd.get("param_groups") or []
        if full_osd["state"] or not any(g["params"] for g in groups):
            return FSDP.rekey_optim_state_dict(full_osd, OptimStateKeyType.PARAM_ID, model, optim=optim)
        # With no state at all (SGD without momentum, no step taken) PyTorch cannot tell the key type and
        # returns the state dict unchanged, param groups still FQN-keyed: give it one empty entry to key by.
        probe = next(f for g in groups for f in g["params"])
        rekeyed = FSDP.rekey_optim_state_dict({**full_osd, "state": {probe: {}}}, OptimStateKeyType.PARAM_ID, model, optim=optim)
        return {**rekeyed, "state": {}}


def fsdp_full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """PyTorch's full, FQN-keyed optimizer state of a live FSDP1 model, on every rank."""
    from torch.distributed.fsdp import (
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), full_optim_config(rank0_only=False)):
            return FSDP.optim_state_dict(model, optim)


def full_optim_config(rank0_only: bool) -> Any:
    """FSDP1's FULL optimizer state-dict config, safe on CPU.

    With ``use_orig_params=True`` and ``offload_to_cpu=True`` (the default),
    torch 2.13 on CPU returns every tensor state of a flat parameter as a view
    of one reused buffer (``.cpu()`` does not copy a CPU tensor), so
    ``exp_avg`` comes back equal to ``exp_avg_sq``. Offloading is only useful
    from a GPU anyway.
    """
    from torch.distributed.fsdp import FullOptimStateDictConfig

    return FullOptimStateDictConfig(offload_to_cpu=torch.cuda.is_available(), rank0_only=rank0_only)
