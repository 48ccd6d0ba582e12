"""A user's own model, importable as ``usermodel:make`` (tests put this folder on the path)."""

from __future__ import annotations

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
