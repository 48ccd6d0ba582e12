"""Small models of the tests' own, named as ``model.factory=testmodels:<function>`` (this folder is on the path, also
for the command's subprocesses)."""

from __future__ import annotations

import torch
from torch import nn

from osdpipe.layout.models import NestedModel


def make_linear() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)


class InputsModel(nn.Module):
    """An embedding, then two linear layers whose weights (and biases) share a shape: IDs cannot be matched by shape."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.proj(self.embed(tokens))))


def make_model(vocab: int = 11, dim: int = 6) -> InputsModel:
    return InputsModel(vocab, dim)


class Unmanaged(NestedModel):
    """A nested model with a parameter directly on the root: with wrap_root=false, FSDP never sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.temperature


def make_unmanaged() -> nn.Module:
    return Unmanaged()


def make_frozen() -> nn.Module:
    """A nested model with frozen parameters inside FSDP units (``use_orig_params=True`` allows that)."""
    model = NestedModel()
    model.block1.leaf1.lin.weight.requires_grad_(False)
    model.block2.gate.requires_grad_(False)
    return model
