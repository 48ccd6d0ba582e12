"""The registry of Hugging Face families (osdpipe/layout/megatron_hf.py): each family module has every function the
registry calls, and each GPT, config.json and layout goes to the family that computes it, a training checkpoint's to
the Llama's alone."""

from __future__ import annotations

import inspect

import pytest

from osdpipe.layout import megatron_gpt2, megatron_hf, megatron_llama
from osdpipe.layout.megatron import Gpt

#: Megatron-LM's args where its command line is silent on the model's build: LayerNorm, learned positions, GeLU.
DEFAULT_GPT = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 128, "num_attention_heads": 4}
LLAMA_GPT = {**DEFAULT_GPT, "normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True}


def _gpt(**changes) -> Gpt:
    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=4,
                kv_channels=8, padded_vocab_size=128, swiglu=True, linear_bias=False)  # fmt: skip
    return Gpt(**{**base, **changes})


@pytest.mark.parametrize("family", megatron_hf.FAMILIES, ids=lambda f: f.__name__.rsplit(".", 1)[1])
def test_every_family_has_each_function_the_registry_calls_with_its_parameters(family) -> None:
    wanted = {name for name in dir(megatron_hf.HfFamily) if not name.startswith("_")}
    assert wanted >= {"fits_args", "to_hf", "megatron_args"}
    for name in sorted(wanted):
        if name == "IN_TRAINING_CHECKPOINTS":
            continue
        declared = inspect.signature(getattr(megatron_hf.HfFamily, name))
        given = inspect.signature(getattr(family, name))
        assert list(given.parameters) == list(declared.parameters)[1:], (family.__name__, name)
    assert isinstance(family.IN_TRAINING_CHECKPOINTS, bool)


def test_the_llama_family_is_asked_last_as_it_fits_every_gpt() -> None:
    assert megatron_hf.FAMILIES[-1] is megatron_llama
    assert megatron_llama.fits_args(DEFAULT_GPT) and megatron_llama.fits_config({"model_type": "gpt2"})


def test_megatron_lms_default_gpt_is_a_gpt2_in_a_model_folder_and_a_refused_llama_in_a_training_checkpoint() -> None:
    assert megatron_hf.family_of_args(DEFAULT_GPT) is megatron_gpt2
    assert megatron_hf.architecture(DEFAULT_GPT) == "GPT2LMHeadModel"
    assert megatron_hf.family_of_args(DEFAULT_GPT, model_folder=False) is megatron_llama
    assert "LayerNorm (not RMSNorm)" in megatron_hf.refusals(DEFAULT_GPT)
    assert megatron_hf.refusals(DEFAULT_GPT, model_folder=True) == []
    assert megatron_hf.family_of_args(LLAMA_GPT) is megatron_llama
    assert megatron_hf.architecture({**LLAMA_GPT, "add_qkv_bias": True, "add_bias_linear": False}) == "Qwen2ForCausalLM"


def test_a_gpt2_config_is_gpt2s_in_a_model_folder_and_refused_as_a_llama_in_a_training_checkpoint() -> None:
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    assert megatron_hf.family_of_config(config) is megatron_gpt2
    assert megatron_hf.hf_refusals(config, model_folder=True) == []
    assert megatron_hf.family_of_config(config, model_folder=False) is megatron_llama
    assert any("not a LlamaForCausalLM" in what for what in megatron_hf.hf_refusals(config))
    assert megatron_hf.family_of_config({"model_type": "llama"}) is megatron_llama


def test_a_layout_with_norm_biases_maps_as_a_gpt2s_and_one_without_as_a_llamas() -> None:
    gpt2 = _gpt(swiglu=False, linear_bias=True, norm_bias=True, position_table=16, tied=True)
    assert megatron_hf.family_of_gpt(gpt2) is megatron_gpt2
    assert "transformer.wpe.weight" in megatron_hf.hf_shapes(gpt2, 100)
    assert megatron_hf.family_of_gpt(_gpt()) is megatron_llama
    assert "model.embed_tokens.weight" in megatron_hf.hf_shapes(_gpt(), 100)
