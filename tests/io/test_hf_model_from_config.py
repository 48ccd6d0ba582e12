"""The model a Hugging Face job's checkpoint is read as, built from its ``config.json``: osdpipe's own parameter tree
(``osdpipe.io.hf_folder.model_from_config``, no transformers needed) and the ``hf_llama`` and ``hf_gpt2`` factories
(transformers' models) must hold exactly transformers' parameters, names, shapes and order, for a Llama with and
without linear biases, tied, a Qwen2 (biases on q, k and v alone), a Qwen3 (a norm on each head's query and key,
heads of its own dimension, tied as its small models are) and a GPT-2 (tied, as transformers builds it by
default, and untied): a PyTorch optimizer keys its state by that order, and a tied model holds one parameter."""

from __future__ import annotations

import pytest

from osdpipe.io.hf_folder import model_from_config
from osdpipe.layout.models import hf_gpt2, hf_llama

transformers = pytest.importorskip("transformers")

DIMS = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 50}  # fmt: skip
GPT2_DIMS = {"n_embd": 32, "n_inner": 48, "n_layer": 2, "n_head": 4, "n_positions": 16, "vocab_size": 50}
#: name -> (config class, model class, its dimensions, the factory that builds it)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", DIMS, hf_llama),
    "llama_biased": ("LlamaConfig", "LlamaForCausalLM", {**DIMS, "attention_bias": True, "mlp_bias": True}, hf_llama),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {**DIMS, "tie_word_embeddings": True}, hf_llama),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DIMS, hf_llama),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**DIMS, "head_dim": 12, "tie_word_embeddings": True}, hf_llama),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT2_DIMS, hf_gpt2),
    "gpt2_untied": ("GPT2Config", "GPT2LMHeadModel", {**GPT2_DIMS, "tie_word_embeddings": False}, hf_gpt2),
}


def _parameters(model) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_tree_read_from_a_config_is_transformers_model(name: str, tmp_path) -> None:
    config_class, model_class, dims, factory = CONFIGS[name]
    config = getattr(transformers, config_class)(**dims)
    config.save_pretrained(tmp_path)
    model = getattr(transformers, model_class)(config)
    theirs = _parameters(model)
    assert any(n.endswith(".bias") for n, _ in theirs) == (name in ("llama_biased", "qwen2", "gpt2", "gpt2_untied"))
    ours = model_from_config(str(tmp_path))
    assert _parameters(ours) == theirs
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (name in ("llama_tied", "qwen3", "gpt2"))
    assert (ours.get_parameter("lm_head.weight") is ours.get_parameter(theirs[0][0])) == tied
    built = factory(**config.to_dict())
    assert type(built).__name__ == model_class and _parameters(built) == theirs
    # its FSDP units are the modules of the classes transformers' _no_split_modules names (what FSDP1 jobs wrap)
    layers = tuple(n for n, m in model.named_modules() if type(m).__name__ in model._no_split_modules)
    assert len(layers) == 2 and ours.fsdp_units == layers


def test_a_llama_biased_on_attention_alone_is_refused_in_one_line(tmp_path) -> None:
    """Megatron biases all four linears or linear_qkv alone: a Llama with attention biases and no MLP biases is
    neither."""
    transformers.LlamaConfig(**DIMS, attention_bias=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention biases without MLP biases") as err:
        model_from_config(str(tmp_path))
    assert "\n" not in str(err.value)
