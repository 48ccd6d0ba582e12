"""A user's own model, importable as ``usermodel:make`` (tests put this folder on the path)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Tower(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(dim, dim) / dim)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.mix
        for e in self.experts:
            x = e(x)
        return x


class UserModel(nn.Module):
    """Parameter numels chosen so that no world size of 2..4 divides every flat parameter."""

    def __init__(self, dim: int = 7, experts: int = 2, towers: int = 2) -> None:
        super().__init__()
        self.dim = dim
        self.towers = nn.ModuleList(Tower(dim, experts) for _ in range(towers))
        self.out = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for t in self.towers:
            x = t(x)
        return self.out(x)


def make(dim: int = 7, experts: int = 2, towers: int = 2) -> UserModel:
    return UserModel(dim, experts, towers)


def save_stepped(path: Path, dim: int) -> Path:
    """``make(dim)`` after one seeded Adam step: its FQN-keyed state saved at ``path`` (an ``fsdp_full`` input)."""
    torch.manual_seed(0)
    model = make(dim=dim)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, dim)).square().mean().backward()
    optim.step()
    names = {p: n for n, p in model.named_parameters()}
    torch.save(
        {
            "state": {names[p]: s for p, s in optim.state.items()},
            "param_groups": [{**optim.param_groups[0], "params": list(names.values())}],
        },
        path,
    )
    return path
