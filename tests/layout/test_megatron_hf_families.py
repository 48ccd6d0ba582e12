"""The registry of Hugging Face families (osdpipe/layout/megatron_hf.py): each family module has every function the
registry calls, and each GPT, config.json and layout goes to the family that computes it, whether a model folder or a
training checkpoint holds it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from osdpipe.layout import megatron_gpt2, megatron_hf, megatron_llama
from osdpipe.layout.megatron import Gpt, global_shapes

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
        declared = inspect.signature(getattr(megatron_hf.HfFamily, name))
        given = inspect.signature(getattr(family, name))
        assert list(given.parameters) == list(declared.parameters)[1:], (family.__name__, name)
    from osdpipe.layout.models import BUILTIN_MODELS

    assert family.HF_FACTORY in BUILTIN_MODELS and family.HF_EMBEDDING in family.hf_shapes(_family_gpt(family), 10)


def _family_gpt(family) -> Gpt:
    """A GPT layout of ``family``."""
    if family is megatron_gpt2:
        return _gpt(swiglu=False, linear_bias=True, norm_bias=True, position_table=16)
    return _gpt()


def test_the_llama_family_is_asked_last_as_it_fits_every_gpt() -> None:
    assert megatron_hf.FAMILIES[-1] is megatron_llama
    assert megatron_llama.fits_args(DEFAULT_GPT) and megatron_llama.fits_config({"model_type": "gpt2"})


def test_megatron_lms_default_gpt_is_a_gpt2() -> None:
    assert megatron_hf.family_of_args(DEFAULT_GPT) is megatron_gpt2
    assert megatron_hf.architecture(DEFAULT_GPT) == "GPT2LMHeadModel"
    assert megatron_hf.hf_factory(DEFAULT_GPT) == "hf_gpt2" and megatron_hf.hf_factory(LLAMA_GPT) == "hf_llama"
    assert megatron_hf.refusals(DEFAULT_GPT) == []
    assert "LayerNorm (not RMSNorm)" in megatron_llama.refusals(DEFAULT_GPT)
    assert megatron_hf.family_of_args(LLAMA_GPT) is megatron_llama
    assert megatron_hf.architecture({**LLAMA_GPT, "add_qkv_bias": True, "add_bias_linear": False}) == "Qwen2ForCausalLM"


def test_a_gpt2_config_is_gpt2s() -> None:
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    assert megatron_hf.family_of_config(config) is megatron_gpt2
    assert megatron_hf.hf_refusals(config) == []
    assert any("not a LlamaForCausalLM" in what for what in megatron_llama.hf_refusals(config))
    assert megatron_hf.family_of_config({"model_type": "llama"}) is megatron_llama


def test_a_layout_with_norm_biases_maps_as_a_gpt2s_and_one_without_as_a_llamas() -> None:
    gpt2 = _gpt(swiglu=False, linear_bias=True, norm_bias=True, position_table=16, tied=True)
    assert megatron_hf.family_of_gpt(gpt2) is megatron_gpt2
    assert "transformer.wpe.weight" in megatron_hf.hf_shapes(gpt2, 100)
    assert megatron_hf.family_of_gpt(_gpt()) is megatron_llama
    assert "model.embed_tokens.weight" in megatron_hf.hf_shapes(_gpt(), 100)


@pytest.mark.parametrize("family", megatron_hf.FAMILIES, ids=lambda f: f.__name__.rsplit(".", 1)[1])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_names_of_lists_each_name_under_the_key_its_elements_come_from(family, tied: bool) -> None:
    """What puts a Megatron param group's keys into Hugging Face names (a training checkpoint's optimizer groups):
    every name :func:`to_hf` gives is listed once, under the one Megatron key whose elements it holds."""
    gpt = dataclasses.replace(_family_gpt(family), tied=tied)
    shapes = global_shapes(gpt)
    keys = sorted(shapes)
    tensors, start = {}, 0
    for key in keys:  # every element of every key a number of its own, so that each output names its key
        n = torch.Size(shapes[key]).numel()
        tensors[key] = torch.arange(start, start + n, dtype=torch.int64).reshape(shapes[key])
        start += n
    bounds = torch.tensor([0, *torch.cumsum(torch.tensor([torch.Size(shapes[k]).numel() for k in keys]), 0)])
    out = megatron_hf.to_hf(gpt, tensors, 100)
    from_keys = {name: {keys[i] for i in (torch.bucketize(t.reshape(-1), bounds, right=True) - 1).tolist()}
                 for name, t in out.items()}
    names_of = megatron_hf.hf_names_of(gpt)
    assert sorted(n for names in names_of.values() for n in names) == sorted(out)
    assert {name: {key} for key, names in names_of.items() for name in names} == from_keys
    assert megatron_hf.tied_names(gpt) == ((family.HF_EMBEDDING, "lm_head.weight") if tied else None)
