"""``none``: the unwrapped model on one process, every parameter whole, state keyed by param ID."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from osdpipe.layout.kinds.base import LayoutKind, register
from osdpipe.layout.ranges import LayoutSpec, LocalTensor, full_layout
from osdpipe.layout.tree import ModuleTree


@register
class NoWrapper(LayoutKind):
    name = "none"
    replicated = True
    one_process = "an unwrapped model's state, one process"

    def saved_format(self, state_dict_type: str) -> str:
        return "plain"

    def refuses_output(self, fmt: Any) -> str | None:
        if fmt.name == self.saved_format("full") or fmt.weights_alone:
            return None
        return (
            "target.kind=none is an unwrapped model, whose optimizer loads one plain state dict: "
            "set output.format=plain"
        )

    def validate(self, spec: LayoutSpec) -> None:
        super().validate(spec)
        if spec.world_size != 1:
            raise ValueError(
                f"kind=none is an unwrapped model on one rank, but world_size={spec.world_size}; set world_size=1"
            )

    def rank_layout(self, tree: ModuleTree, spec: LayoutSpec, rank: int) -> tuple[LocalTensor, ...]:
        return full_layout(tree)

    def wrap(self, model: nn.Module, spec: LayoutSpec) -> nn.Module:
        return model

    def to_load(self, model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any]) -> dict[str, Any]:
        """PyTorch's rekeying of a full FQN-keyed state by this optimizer's param IDs."""
        # torch.distributed.fsdp is heavy: only a live model needs it, not the launcher's config check
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
            rekeyed = FSDP.rekey_optim_state_dict(
                {**full_osd, "state": {probe: {}}}, OptimStateKeyType.PARAM_ID, model, optim=optim
            )
            return {**rekeyed, "state": {}}

    def full_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """``get_optimizer_state_dict`` with ``full_state_dict``:
        keyed by FQN (DDP's ``module.`` dropped), in the optimizer's order."""
        # DCP is heavy: only a live model needs it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))

    def save(self, model: nn.Module, optim: torch.optim.Optimizer, path: Path, state_dict_type: str, key: str) -> None:
        """Its optimizer's own, param-ID keyed ``state_dict()`` (a ``plain`` file)."""
        torch.save(optim.state_dict(), path)
