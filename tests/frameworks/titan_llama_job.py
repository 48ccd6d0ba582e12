"""torchtitan's llama3 or qwen3 of a converted Megatron GPT, as ``titan_load.py`` trains it: built from the
``model_args.json`` osdpipe wrote beside the step folder, by torchtitan's own config classes
(``osdpipe.layout.models``' ``torchtitan_llama3`` and ``torchtitan_qwen3``), its forward taking token ids alone (the
positions and the causal block masks torchtitan's trainer gives, made here), its FlexAttention run as SDPA under the
same block-causal mask: FlexAttention has no backward on CPU (``titan_train._patch_attention``, as torchtitan's trainer
runs in these tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from osdpipe.layout.models import torchtitan_llama3, torchtitan_qwen3


def megatron_llama3(args: str) -> nn.Module:
    """torchtitan's llama3 ``args`` (a ``model_args.json``) describes; ``blocks`` are its FSDP units, ``vocab`` its
    tokens."""
    return _on_ids(torchtitan_llama3, args)


def megatron_qwen3(args: str) -> nn.Module:
    """torchtitan's qwen3 ``args`` describes, as :func:`megatron_llama3`."""
    return _on_ids(torchtitan_qwen3, args)


def _on_ids(factory: Callable[..., nn.Module], args: str) -> nn.Module:
    from frameworks.titan_train import _patch_attention

    _patch_attention()
    kwargs = json.loads(Path(args).read_text())
    model = factory(**kwargs)
    forward = model.forward

    def on_ids(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        return forward(ids, positions, model.get_attention_masks(positions))

    model.forward = on_ids
    model.blocks = list(model.layers.values())
    model.vocab = kwargs["vocab_size"]
    return model


def fused_wqkv(model: dict[str, torch.Tensor], layer: int, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """torchtitan's ``wqkv`` parameter of layer ``layer`` from the ``wq``, ``wk``, ``wv`` its state dict saves (per
    key/value group: its query heads, its key head, its value head; torchtitan's ``FusedQKVLinear``)."""
    p = f"layers.{layer}.attention.qkv_linear."
    q, k, v = (model[f"{p}{w}.weight"] for w in ("wq", "wk", "wv"))
    n, g, cols = n_heads // n_kv_heads, n_kv_heads, q.shape[1]
    d = q.shape[0] // n_heads
    fused = torch.cat([q.reshape(g, n, d, cols), k.reshape(g, 1, d, cols), v.reshape(g, 1, d, cols)], dim=1)
    return fused.reshape(-1, cols)


def parameters(model: dict[str, torch.Tensor], args: dict) -> dict[str, torch.Tensor]:
    """A torchtitan llama3 state dict (``wq``, ``wk``, ``wv`` as its hooks save them) as its parameters (``wqkv``)."""
    out = {k: v for k, v in model.items() if ".qkv_linear.w" not in k}
    for i in range(args["n_layers"]):
        out[f"layers.{i}.attention.qkv_linear.wqkv.weight"] = fused_wqkv(model, i, args["n_heads"], args["n_kv_heads"])
    return out
