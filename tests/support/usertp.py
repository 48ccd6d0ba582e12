"""A user's own tensor-parallel model, importable as ``usertp:build``: osdpipe has never seen it.

Token IDs in (an ``nn.Embedding``), a head tied to the embedding and left
outside the TP plan, a hidden size (33) that ``tp_size=2`` does not divide,
and a plan as torchtitan writes one: ``up`` colwise, ``down`` rowwise, the
norm ``sequence``. ``gate`` is in no plan: FSDP2 alone shards it.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, HIDDEN = 11, 6, 33

#: The plan the tests give ``source.tp_plan`` / ``target.tp_plan``.
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "blocks.*.norm": "sequence"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.gate = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x)))) * torch.sigmoid(self.gate(x))


class TinyTP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> TinyTP:
    return TinyTP()
