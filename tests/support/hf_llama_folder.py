"""A small Hugging Face Llama folder as ``save_pretrained`` writes one (config.json, safetensors shards and their
index), written by osdpipe's own safetensors writer: the source of the ``checkpoint=hf`` tests that need neither
transformers nor Megatron (tests/pipeline/test_weights_only_megatron.py, tests/cloud/test_s3_megatron.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from osdpipe.io import hf_folder
from osdpipe.io.formats.megatron import gpt_of
from osdpipe.layout import megatron_hf

#: A Llama's config.json (GQA, untied, vocabulary 50: padded to 256 at TP2).
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 50, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu"}


def write_llama(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A folder as ``save_pretrained`` writes one, in shards with an index; its tensors."""
    gpt = gpt_of(megatron_hf.megatron_args(CONFIG, 1, 1, 1))
    g = torch.Generator().manual_seed(seed)
    shapes = megatron_hf.hf_shapes(gpt, CONFIG["vocab_size"])
    state = {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}
    folder.mkdir(parents=True)
    hf_folder.write_folder(folder, CONFIG, state, max_shard_size=20_000)
    return state
