"""A user's own language model, importable as ``userlm:build``: osdpipe has never seen it.

Fed token IDs (an ``nn.Embedding`` first), no ``example_input``, a factory
without arguments, a head tied to the embedding, and parameters that share a
shape (``wq`` and ``wk`` of every block), which is what makes order-based
rekeying dangerous.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 11, 6


class MixerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.wq(self.norm(x))) * self.wk(x)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MixerBlock() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> TinyLM:
    return TinyLM()
