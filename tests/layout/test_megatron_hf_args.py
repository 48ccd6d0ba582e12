"""``megatron_hf.megatron_args``: a Hugging Face Llama's (or a model folder's Qwen2's or Qwen3's) ``config.json`` ->
Megatron-LM's ``args``, pure.

It is :func:`~osdpipe.layout.megatron_hf.hf_config`'s inverse on every dimension the map and the layout read, pads the
vocabulary as Megatron-LM does for the TP, and refuses in one line what a Megatron GPT cannot be or a grid that does not
divide the model.
"""

from __future__ import annotations

import pytest

from osdpipe.io.formats.megatron import gpt_of
from osdpipe.layout.megatron_hf import hf_config, hf_refusals, megatron_args

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 4, "vocab_size": 50,
         "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
         "max_position_embeddings": 32, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
         "hidden_act": "silu"}


@pytest.mark.parametrize(("tp", "pp", "world", "padded"), [(1, 1, 1, 128), (2, 2, 4, 256), (2, 1, 8, 256)])
def test_args_are_hf_configs_inverse_and_pad_the_vocabulary_for_the_tp(tp, pp, world, padded) -> None:
    args = megatron_args(LLAMA, tp, pp, world, iteration=7)
    back = hf_config(args)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert back[key] == LLAMA[key], key
    assert back["rope_theta"] == 500000.0
    assert args["padded_vocab_size"] == padded and args["data_parallel_size"] == world // (tp * pp)
    assert args["iteration"] == 7 and args["ckpt_format"] == "torch_dist" and args["use_distributed_optimizer"]
    gpt = gpt_of(args)
    assert (gpt.num_query_groups, gpt.kv_channels, gpt.padded_vocab_size) == (2, 8, padded)


def test_multi_head_attention_has_no_query_groups() -> None:
    args = megatron_args({**LLAMA, "num_key_value_heads": 4}, 1, 1, 1)
    assert not args["group_query_attention"] and gpt_of(args).num_query_groups == 4


@pytest.mark.parametrize(("change", "said"), [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "not a LlamaForCausalLM"),
    ({"attention_bias": True}, "attention biases"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"hidden_act": "gelu"}, "gelu activation"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "high_freq_factor": 2.0}},
     "RoPE scaling other than Llama 3.1's"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}}, "RoPE scaling"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling"),
    ({"num_key_value_heads": 3}, "4 attention heads in 3 key/value heads"),
])
def test_what_megatron_cannot_express_is_refused_in_one_line(change, said) -> None:
    assert any(said in what for what in hf_refusals({**LLAMA, **change}))
    with pytest.raises(ValueError, match="not supported yet as a Megatron GPT") as err:
        megatron_args({**LLAMA, **change}, 1, 1, 1)
    assert said in str(err.value) and "\n" not in str(err.value)


QWEN2 = {**{k: v for k, v in LLAMA.items() if k not in ("attention_bias", "mlp_bias")},
         "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}


@pytest.mark.parametrize(("config", "flags", "architecture"), [
    ({**LLAMA, "attention_bias": True, "mlp_bias": True}, (True, False), "LlamaForCausalLM"),
    (QWEN2, (False, True), "Qwen2ForCausalLM"),
])
def test_biases_are_megatrons_and_back(config, flags, architecture) -> None:
    """A model folder's or a PyTorch job's (the HF Trainer's) Llama with attention_bias and mlp_bias is Megatron's
    add_bias_linear, a Qwen2 its add_qkv_bias, and hf_config gives the same architecture back."""
    args = megatron_args(config, 2, 1, 2)
    assert (args["add_bias_linear"], args["add_qkv_bias"]) == flags
    gpt = gpt_of(args)
    assert (gpt.linear_bias, gpt.has_qkv_bias) == (flags[0], True)
    back = hf_config(args)
    assert back["architectures"] == [architecture] and back["model_type"] == config["model_type"]
    assert {k: back.get(k) for k in ("attention_bias", "mlp_bias")} == \
        {k: config.get(k) for k in ("attention_bias", "mlp_bias")}
    assert hf_refusals(config) == []


def test_a_llamas_tied_embeddings_are_megatrons_and_back() -> None:
    """``tie_word_embeddings`` (a model folder's, or a PyTorch job's Llama's, the HF Trainer's) is Megatron's tied
    embedding (no output layer of its own), and hf_config says it again."""
    config = {**LLAMA, "tie_word_embeddings": True}
    args = megatron_args(config, 2, 2, 4)
    assert args["untie_embeddings_and_output_weights"] is False and gpt_of(args).tied
    assert hf_config(args)["tie_word_embeddings"] is True
    assert hf_refusals(config) == []


@pytest.mark.parametrize(("change", "said"), [
    ({**LLAMA, "attention_bias": True}, "attention biases without MLP biases"),
    ({**LLAMA, "mlp_bias": True}, "attention biases without MLP biases"),
    ({**QWEN2, "use_sliding_window": True}, "sliding-window attention"),
    ({**QWEN2, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "RoPE scaling in a Qwen2"),
    ({**QWEN2, "head_dim": 16}, "a head dimension other than hidden / heads in a Qwen2"),
    ({**QWEN2, "model_type": "qwen3", "architectures": ["Qwen2ForCausalLM"]}, "not a LlamaForCausalLM, Qwen2"),
    ({**QWEN2, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "not a LlamaForCausalLM, Qwen2"),
])
def test_what_biases_cannot_be_in_megatron_is_refused_in_one_line(change, said) -> None:
    with pytest.raises(ValueError, match="not supported yet as a Megatron GPT") as err:
        megatron_args(change, 1, 1, 1)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_tp_that_is_a_multiple_of_the_key_value_heads_is_taken_as_megatron_core_takes_it() -> None:
    """megatron-core's ``TransformerConfig`` takes a TP that the key/value heads divide (each head then on
    ``tp / groups`` ranks), and so did a Megatron save converted to TP4; a Hugging Face model was refused it ("choose a
    TP that does: 1, 2"). Both directions take megatron-core's rule."""
    args = megatron_args(LLAMA, 4, 1, 4)
    assert (args["tensor_model_parallel_size"], args["num_query_groups"], args["group_query_attention"]) == (4, 2, True)
    assert args["padded_vocab_size"] == 512
    gpt = gpt_of(args)
    assert (gpt.num_attention_heads, gpt.num_query_groups) == (4, 2)


@pytest.mark.parametrize(("tp", "pp", "world", "vpp", "said"), [
    (3, 1, 3, 1, "does not divide the model's 4 attention heads"),
    (8, 1, 8, 1, "does not divide the model's 4 attention heads"),
    (1, 3, 3, 1, "does not divide the model's 4 layers"),
    (2, 2, 6, 1, "no multiple of TP 2 x PP 2"),
    (1, 2, 2, 4, "target.pp_size=2 x target.vpp_size=4 does not divide the model's 4 layers"),
    (1, 1, 1, 2, "virtual pipeline stages interleave several pipeline stages"),
])
def test_a_grid_that_does_not_divide_the_model_is_refused(tp, pp, world, vpp, said) -> None:
    with pytest.raises(ValueError, match=said):
        megatron_args(LLAMA, tp, pp, world, vpp=vpp)


def test_a_tp_the_key_value_heads_neither_divide_nor_are_divided_by_is_refused() -> None:
    """6 heads in 3 key/value heads at TP2: the heads split, the key/value heads neither split over 2 ranks nor fill
    them whole (megatron-core refuses it too)."""
    with pytest.raises(ValueError) as err:
        megatron_args({**LLAMA, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}, 2, 1, 2)
    assert str(err.value) == ("target.tp_size=2 neither divides nor is a multiple of the model's 3 key/value heads "
                              "(query groups); choose a TP that does: 1, 3, 6")


def test_virtual_stages_are_recorded_as_megatron_lm_records_them() -> None:
    """``--num-layers-per-virtual-pipeline-stage`` and the size Megatron-LM derives from it, which its
    ``load_args_from_checkpoint`` reads back; none without virtual stages."""
    args = megatron_args(LLAMA, 1, 2, 2, vpp=2)
    assert (args["virtual_pipeline_model_parallel_size"], args["num_layers_per_virtual_pipeline_stage"]) == (2, 1)
    plain = megatron_args(LLAMA, 1, 2, 2)
    assert (plain["virtual_pipeline_model_parallel_size"], plain["num_layers_per_virtual_pipeline_stage"]) == (None,
                                                                                                              None)


def test_llama_3_1_rope_scaling_is_megatrons_use_rope_scaling() -> None:
    """transformers' ``llama3`` rope type with megatron-core's fixed frequency factors (1, 4) and 8192 positions is
    ``--use-rope-scaling --rope-scaling-factor``; transformers 4's ``rope_scaling`` spelling too."""
    from osdpipe.layout.megatron_hf import megatron_args

    llama31 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    transformers4 = {k: v for k, v in llama31.items() if k != "rope_theta"}
    for config in ({**LLAMA, "rope_parameters": llama31}, {**LLAMA, "rope_theta": 5e5, "rope_scaling": transformers4}):
        args = megatron_args(config, 1, 1, 1)
        assert (args["use_rope_scaling"], args["rope_scaling_factor"], args["rotary_base"]) == (True, 32.0, 500000)
    assert megatron_args(LLAMA, 1, 1, 1)["use_rope_scaling"] is False


def test_megatrons_use_rope_scaling_is_llama_3_1s_in_transformers_and_torchtitan() -> None:
    """The way back: a GPT saved with ``--use-rope-scaling --rope-scaling-factor 32`` is transformers' ``llama3`` rope
    type and torchtitan's ``llama`` scaling with megatron-core's fixed frequency factors and positions, and reads back
    as the same args; an unscaled GPT stays unscaled in both."""
    from osdpipe.layout.megatron_hf import hf_config, megatron_args, titan_args

    llama31 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    args = megatron_args({**LLAMA, "rope_parameters": llama31}, 1, 1, 1)
    config = hf_config(args)
    assert config["rope_parameters"] == llama31
    assert megatron_args(config, 1, 1, 1) == args
    assert titan_args(args, vocab_size=LLAMA["vocab_size"])["rope_scaling"] == {
        "scaling_factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192.0}
    plain = megatron_args(LLAMA, 1, 1, 1)
    assert hf_config(plain)["rope_parameters"]["rope_type"] == "default"
    assert "rope_scaling" not in titan_args(plain, vocab_size=LLAMA["vocab_size"])


QWEN3 = {**QWEN2, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16, "attention_bias": False}


def test_a_qwen3_is_megatrons_qk_layernorm_and_back() -> None:
    """A Qwen3 (a norm on each head's query and key, no biases, a head dimension of its own) is Megatron's GPT with
    ``qk_layernorm`` and ``kv_channels``, whose layout holds the two norms; hf_config gives the Qwen3 back."""
    args = megatron_args(QWEN3, 2, 2, 4)
    assert (args["qk_layernorm"], args["add_bias_linear"], args["add_qkv_bias"], args["kv_channels"]) == \
        (True, False, False, 16)
    gpt = gpt_of(args)
    assert gpt.qk_layernorm and not gpt.has_qkv_bias and gpt.kv_channels == 16
    back = hf_config(args)
    assert (back["architectures"], back["model_type"], back["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3", 16)
    assert back["attention_bias"] is False and hf_refusals(QWEN3) == []
    assert megatron_args(LLAMA, 2, 2, 4)["qk_layernorm"] is False


@pytest.mark.parametrize(("change", "said"), [
    ({"attention_bias": True}, "attention_bias in a Qwen3"),
    ({"use_sliding_window": True}, "sliding-window attention"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "RoPE scaling in a Qwen3"),
])
def test_what_a_qwen3_has_and_megatron_cannot_is_refused_in_one_line(change, said) -> None:
    with pytest.raises(ValueError, match="not supported yet as a Megatron GPT") as err:
        megatron_args({**QWEN3, **change}, 1, 1, 1)
    assert said in str(err.value) and "\n" not in str(err.value)
