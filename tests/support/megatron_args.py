"""The Megatron-LM ``args`` of the small GPTs the map tests build: a GPT-2 (learned positions, LayerNorm, GELU, an
odd vocabulary) and a Llama (RoPE, RMSNorm, SwiGLU, grouped queries). Shared by tests/layout's map tests and
tests/io/test_mapped_reader.py; kept here, not imported from one test module into another, where a package that
ships a top-level ``tests`` of its own (veRL's wheel does) would shadow the repository's."""

from __future__ import annotations

#: The GPT-2's vocabulary: odd, so the padded rows (32) are not a multiple of it.
GPT2_VOCAB = 29

GPT2_ARGS = {"num_layers": 2, "hidden_size": 12, "ffn_hidden_size": 20, "num_attention_heads": 3,
             "max_position_embeddings": 8, "padded_vocab_size": 32, "vocab_size": GPT2_VOCAB, "norm_epsilon": 1e-5,
             "hidden_dropout": 0.0, "attention_dropout": 0.0}  # fmt: skip

LLAMA_ARGS = dict(
    num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
    group_query_attention=True, kv_channels=16, seq_length=16, max_position_embeddings=16, normalization="RMSNorm",
    norm_epsilon=1e-5, swiglu=True, squared_relu=False, position_embedding_type="rope",
    use_rotary_position_embeddings=True, rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
    untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
    num_experts=None, vocab_size=1000, padded_vocab_size=1024, bf16=False, fp16=False,
)
