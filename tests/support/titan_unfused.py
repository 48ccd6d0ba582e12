"""torchtitan's llama3 ``debugmodel`` with ``fuse_qkv=False``: a user's own variant of a registry model.

Its ``state_dict()`` is the registry model's, names and shapes (the fused model's hooks save ``wqkv`` as ``wq``,
``wk``, ``wv``), but its parameters are ``wq``, ``wk``, ``wv``, so its optimizer's state is keyed by other names
than the registry model's. ``osdpipe inspect`` must not name the registry model for it.
"""

from __future__ import annotations

from functools import partial

from torch import nn

FLAVOR = "debugmodel"


def build() -> nn.Module:
    """The model, its attention unfused; everything else as torchtitan's llama3 ``debugmodel`` config builds it."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.config_utils import make_gqa_config

    config = llama3.model_registry(FLAVOR).model
    for layer in config.layers:
        fused = layer.attention
        layer.attention = make_gqa_config(
            dim=fused.dim, n_heads=fused.n_heads, n_kv_heads=fused.n_kv_heads, head_dim=fused.head_dim,
            wqkv_param_init={"weight": partial(nn.init.trunc_normal_, std=0.02)}, wo_param_init=fused.wo.param_init,
            inner_attention=fused.inner_attention, rope=fused.rope, fuse_qkv=False,
        )
    return config.build()
