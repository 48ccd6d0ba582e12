"""A user's own optimizer, importable as ``useroptim:SignMomentum`` (tests put this folder on the path).

Its state names are none of torch.optim's: a tensor ``trace`` of the
parameter's shape and a 0-dim ``count``, so a conversion that assumed Adam's
names (``exp_avg``, ``step``) would lose them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class SignMomentum(torch.optim.Optimizer):
    """Momentum of the gradient, applied through its sign."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["count"] = torch.tensor(0.0)
                    state["trace"] = torch.zeros_like(p)
                state["count"] += 1
                state["trace"].mul_(group["beta"]).add_(p.grad)
                p.add_(state["trace"].sign(), alpha=-group["lr"])
        return loss


class ElementwiseSignMomentum(SignMomentum):
    """The same, saying so: osdpipe's resume check then steps each rank's own ranges, at any size."""

    osdpipe_elementwise = True


class NotAnOptimizer:
    """Named by a test as ``useroptim:NotAnOptimizer``, which the config must refuse."""
