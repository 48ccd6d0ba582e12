"""The model a Hugging Face job's checkpoint is read as, built from its ``config.json``: osdpipe's own parameter tree
(``osdpipe.io.hf_folder.llama_from_config``, no transformers needed) and the ``hf_llama`` factory (transformers'
model) must hold exactly transformers' parameters, names, shapes and order, for a Llama with and without linear
biases, tied, and a Qwen2 (biases on q, k and v alone): a PyTorch optimizer keys its state by that order."""

from __future__ import annotations

import pytest

from osdpipe.io.hf_folder import llama_from_config
from osdpipe.layout.models import hf_llama

transformers = pytest.importorskip("transformers")

DIMS = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 50}  # fmt: skip
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_biased": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}


def _parameters(model) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_tree_read_from_a_config_is_transformers_model(name: str, tmp_path) -> None:
    config_class, model_class, extra = CONFIGS[name]
    config = getattr(transformers, config_class)(**DIMS, **extra)
    config.save_pretrained(tmp_path)
    theirs = _parameters(getattr(transformers, model_class)(config))
    assert any(n.endswith(".bias") for n, _ in theirs) == (name in ("llama_biased", "qwen2"))
    assert _parameters(llama_from_config(str(tmp_path))) == theirs
    built = hf_llama(**config.to_dict())
    assert type(built).__name__ == model_class and _parameters(built) == theirs


def test_a_llama_biased_on_attention_alone_is_refused_in_one_line(tmp_path) -> None:
    """Megatron biases all four linears or linear_qkv alone: a Llama with attention biases and no MLP biases is
    neither."""
    transformers.LlamaConfig(**DIMS, attention_bias=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention biases without MLP biases") as err:
        llama_from_config(str(tmp_path))
    assert "\n" not in str(err.value)
