"""The tests' own model whose state dict is not its parameters: keys made by state-dict hooks,
as torchtitan's fused ``wqkv`` saves.

* Each block's ``up_gate`` is one parameter whose rows interleave an up and a
  gate projection in groups of ``group`` rows; its hooks save it as ``up``
  and ``gate`` (each a set of row blocks of it) and merge them on load,
  gathering a DTensor whole first, as torchtitan's ``FusedQKVLinear`` does.
* The root saves ``embed.weight`` as ``tok_embeddings.weight`` and renames it
  back on load; the head is tied to the embedding.
* Odd sizes, so FSDP2's dim-0 chunks cut through the interleaved blocks.

osdpipe has never seen it: its keys are learned from ``state_dict()`` alone.
"""

from __future__ import annotations

import torch
from torch import nn


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(tensor, DTensor):
        return tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
    return tensor


class FusedUpGate(nn.Module):
    def __init__(self, dim: int, hidden: int, group: int) -> None:
        super().__init__()
        assert hidden % group == 0
        self.group = group
        self.up_gate = nn.Parameter(torch.randn(2 * hidden, dim) / dim)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = (x @ self.up_gate.t()).unflatten(-1, (-1, 2, self.group))
        return self.down((both[..., 0, :] * torch.sigmoid(both[..., 1, :])).flatten(-2))

    @staticmethod
    def _split(module: FusedUpGate, state: dict, prefix: str, local_metadata: dict) -> None:
        fused = _replicated(state.pop(f"{prefix}up_gate"))
        blocks = fused.reshape(-1, 2, module.group, fused.shape[-1])
        state[f"{prefix}up"] = blocks[:, 0].reshape(-1, fused.shape[-1]).contiguous()
        state[f"{prefix}gate"] = blocks[:, 1].reshape(-1, fused.shape[-1]).contiguous()

    @staticmethod
    def _merge(module: FusedUpGate, state: dict, prefix: str, *args) -> None:
        if f"{prefix}up" not in state:
            return
        up, gate = _replicated(state.pop(f"{prefix}up")), _replicated(state.pop(f"{prefix}gate"))
        width = up.shape[-1]
        both = torch.stack([up.reshape(-1, module.group, width), gate.reshape(-1, module.group, width)], dim=1)
        state[f"{prefix}up_gate"] = both.reshape(-1, width)


class FusedBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, group: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = FusedUpGate(dim, hidden, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class FusedLM(nn.Module):
    fsdp_units = ("FusedBlock",)

    def __init__(self, vocab: int = 19, dim: int = 6, hidden: int = 9, group: int = 3, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(FusedBlock(dim, hidden, group) for _ in range(blocks))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_state_dict_post_hook(self._rename)
        self.register_load_state_dict_pre_hook(self._rename_back)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @staticmethod
    def _rename(module: FusedLM, state: dict, prefix: str, local_metadata: dict) -> None:
        state[f"{prefix}tok_embeddings.weight"] = state.pop(f"{prefix}embed.weight")

    @staticmethod
    def _rename_back(module: FusedLM, state: dict, prefix: str, *args) -> None:
        if f"{prefix}tok_embeddings.weight" in state:
            state[f"{prefix}embed.weight"] = state.pop(f"{prefix}tok_embeddings.weight")


def build(**kwargs) -> FusedLM:
    return FusedLM(**kwargs)
