"""torchtitan's llama3 of a converted Megatron GPT, as ``titan_load.py`` trains it: built from the
``model_args.json`` osdpipe wrote beside the step folder, by torchtitan's own config classes
(``osdpipe.layout.models.torchtitan_llama3``), its forward taking token ids alone (the positions and the causal block
masks torchtitan's trainer gives, made here), its FlexAttention run as SDPA under the same block-causal mask:
FlexAttention has no backward on CPU (``titan_train._patch_attention``, as torchtitan's trainer runs in these tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from osdpipe.layout.models import torchtitan_llama3


def megatron_llama3(args: str) -> nn.Module:
    """The model ``args`` (a ``model_args.json``) describes; ``blocks`` are its FSDP units, ``vocab`` its tokens."""
    from frameworks.titan_train import _patch_attention

    _patch_attention()
    kwargs = json.loads(Path(args).read_text())
    model = torchtitan_llama3(**kwargs)
    forward = model.forward

    def on_ids(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        return forward(ids, positions, model.get_attention_masks(positions))

    model.forward = on_ids
    model.blocks = list(model.layers.values())
    model.vocab = kwargs["vocab_size"]
    return model
