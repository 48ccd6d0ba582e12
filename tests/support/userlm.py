"""A user's own language model, importable as ``userlm:build``: osdpipe has never seen it.

Fed token IDs (an ``nn.Embedding`` first), no ``example_input``, a factory
without arguments, a head tied to the embedding, a persistent buffer, and
parameters that share a shape (``wq`` and ``wk`` of every block), which is
what makes order-based rekeying dangerous.
"""

from __future__ import annotations

from pathlib import Path

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
        # a persistent buffer: in model.state_dict(), cut by no layout
        self.register_buffer("feature_scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.feature_scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> TinyLM:
    return TinyLM()


def train(model: nn.Module, steps: int) -> torch.optim.Optimizer:
    """A user's training loop: Adam, ``steps`` steps on 4x5 token batches
    (batch ``i`` seeded by ``i``), a real backward."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(step))
        model(tokens).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return optim


def fqn_keyed(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """An unwrapped model's ``optim.state_dict()`` keyed by FQN: the full state PyTorch's FSDP conversions take."""
    names = [name for name, _ in model.named_parameters()]
    state = optim.state_dict()
    return {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def save_trained(path: Path, steps: int) -> Path:
    """The user's unwrapped job, seeded: ``steps`` Adam steps, its FQN-keyed state saved at ``path``
    (an ``fsdp_full`` input)."""
    torch.manual_seed(0)
    model = build()
    torch.save(fqn_keyed(model, train(model, steps)), path)
    return path


def batches(first: int, count: int) -> list[torch.Tensor]:
    """``count`` 4x5 token batches, batch ``i`` seeded by ``first + i``."""
    return [torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(first + i)) for i in range(count)]


def steps(model: nn.Module, optim: torch.optim.Optimizer, tokens: list[torch.Tensor]) -> None:
    """A user's training loop with their own optimizer: a real forward and backward per batch, then a step."""
    for batch in tokens:
        model(batch).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def fully_shard_blocks(model: TinyLM) -> nn.Module:
    """A user's FSDP2 wrapping on the current world: ``fully_shard`` on every block, then on the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)
