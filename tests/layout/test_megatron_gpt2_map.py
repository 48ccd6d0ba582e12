"""Megatron-LM's default GPT <-> Hugging Face's GPT-2: the map's rules, without Megatron or transformers.

Where each element lands (every head's q, k and v rows become ``c_attn``'s columns, every linear transposed into a
Conv1D), that the map is a permutation and comes back bitwise, what the config says and what GPT-2 cannot express.
That transformers' GPT-2 computes megatron-core's logits is tests/frameworks/test_megatron_hf_biases.py's.
"""

from __future__ import annotations

import pytest
import torch
from megatron_args import GPT2_ARGS, GPT2_VOCAB

from osdpipe.layout import megatron_gpt2, megatron_hf, megatron_llama
from osdpipe.layout.megatron import Gpt, global_shapes

#: Megatron-LM's default GPT, small: MHA (3 heads of 4), LayerNorm, a learned position table, biases, tied.
GPT = Gpt(num_layers=2, hidden_size=12, ffn_hidden_size=20, num_attention_heads=3, num_query_groups=3, kv_channels=4,
          padded_vocab_size=32, swiglu=False, linear_bias=True, norm_bias=True, position_table=8, tied=True)
VOCAB = GPT2_VOCAB
#: Its args, as Megatron-LM records them where the defaults hold.
ARGS = GPT2_ARGS


def _indexed(gpt: Gpt) -> dict[str, torch.Tensor]:
    """Every element a distinct value: its key's index times a million plus its flat index."""
    return {k: (torch.arange(torch.Size(s).numel(), dtype=torch.float64) + 1e6 * i).reshape(s)
            for i, (k, s) in enumerate(global_shapes(gpt).items())}


@pytest.mark.parametrize("tied", [True, False])
def test_each_head_and_linear_lands_where_gpt2_reads_it(tied: bool) -> None:
    gpt = Gpt(**{**GPT.__dict__, "tied": tied})
    x = _indexed(gpt)
    hf = megatron_gpt2.to_hf(gpt, x, VOCAB)
    assert {k: tuple(v.shape) for k, v in hf.items()} == megatron_gpt2.hf_shapes(gpt, VOCAB)
    assert ("lm_head.weight" in hf) == (not tied)
    d, heads = gpt.kv_channels, gpt.num_attention_heads
    qkv = x["decoder.layers.self_attention.linear_qkv.weight"]
    qkv_bias = x["decoder.layers.self_attention.linear_qkv.bias"]
    for i in range(gpt.num_layers):
        p = f"transformer.h.{i}."
        c_attn = hf[p + "attn.c_attn.weight"]  # [in, out]: column c is output c
        for head in range(heads):
            for part in range(3):  # q, k, v
                megatron_rows = slice(3 * head * d + part * d, 3 * head * d + (part + 1) * d)
                columns = slice(part * heads * d + head * d, part * heads * d + (head + 1) * d)
                assert torch.equal(c_attn[:, columns], qkv[i, megatron_rows].t())
                assert torch.equal(hf[p + "attn.c_attn.bias"][columns], qkv_bias[i, megatron_rows])
        assert torch.equal(hf[p + "mlp.c_fc.weight"], x["decoder.layers.mlp.linear_fc1.weight"][i].t())
        assert torch.equal(hf[p + "mlp.c_proj.weight"], x["decoder.layers.mlp.linear_fc2.weight"][i].t())
        assert torch.equal(hf[p + "attn.c_proj.weight"], x["decoder.layers.self_attention.linear_proj.weight"][i].t())
        assert torch.equal(hf[p + "ln_1.bias"], x["decoder.layers.self_attention.linear_qkv.layer_norm_bias"][i])
        assert torch.equal(hf[p + "ln_2.weight"], x["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i])
    assert torch.equal(hf["transformer.wte.weight"], x["embedding.word_embeddings.weight"][:VOCAB])
    assert torch.equal(hf["transformer.wpe.weight"], x["embedding.position_embeddings.weight"])
    assert torch.equal(hf["transformer.ln_f.bias"], x["decoder.final_layernorm.bias"])
    assert all(t.is_contiguous() for t in hf.values())


def test_the_map_is_a_permutation_and_comes_back_bitwise_but_the_padding_rows() -> None:
    x = _indexed(GPT)
    hf = megatron_gpt2.to_hf(GPT, x, VOCAB)
    sent = torch.cat([t.reshape(-1) for t in hf.values()])
    kept = torch.cat([(t[:VOCAB] if k == "embedding.word_embeddings.weight" else t).reshape(-1) for k, t in x.items()])
    assert torch.equal(sent.sort().values, kept.sort().values)  # each element once, nothing else
    back = megatron_gpt2.from_hf(GPT, hf)
    for key, t in x.items():
        expected = t.clone()
        if key == "embedding.word_embeddings.weight":
            expected[VOCAB:] = 0
        assert torch.equal(back[key], expected), key
    # through megatron_hf, which sends a GPT with LayerNorm here
    assert torch.equal(megatron_hf.from_hf(GPT, megatron_hf.to_hf(GPT, x, VOCAB))["decoder.final_layernorm.bias"],
                       x["decoder.final_layernorm.bias"])


def test_the_config_is_gpt2s_and_the_gelu_the_one_the_job_computed() -> None:
    config = megatron_hf.hf_config(ARGS, dtype="float32")
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_inner"], config["n_positions"],
            config["vocab_size"], config["tie_word_embeddings"]) == (12, 2, 3, 20, 8, VOCAB, True)
    # Megatron-LM fuses the bias and the GeLU by default: the tanh approximation (transformers' gelu_new)
    assert config["activation_function"] == "gelu_new"
    assert megatron_gpt2.activation({**ARGS, "bias_gelu_fusion": False}) == "gelu"
    assert megatron_gpt2.activation({**ARGS, "bias_gelu_fusion": False, "openai_gelu": True}) == "gelu_new"
    assert megatron_hf.architecture(ARGS) == "GPT2LMHeadModel"
    assert megatron_hf.hf_config({**ARGS, "untie_embeddings_and_output_weights": True})["tie_word_embeddings"] is False


@pytest.mark.parametrize("change, said", [
    ({"group_query_attention": True, "num_query_groups": 1}, "grouped-query attention"),
    ({"swiglu": True}, "SwiGLU"),
    ({"add_bias_linear": False}, "linears without biases"),
    ({"kv_channels": 8}, "a head dimension other than hidden / heads"),
    ({"qk_layernorm": True}, "qk_layernorm"),
])
def test_what_gpt2_cannot_express_is_refused_in_one_line(change: dict, said: str) -> None:
    with pytest.raises(ValueError, match="not supported yet as a Hugging Face GPT-2") as err:
        megatron_hf.hf_config({**ARGS, **change})
    assert said in str(err.value) and "\n" not in str(err.value)
    # the Llama family, which fits every GPT, refuses the GPT-2 itself in its own words; the registry asks GPT-2's
    assert "LayerNorm (not RMSNorm)" in ", ".join(megatron_llama.refusals(ARGS))
    assert megatron_hf.refusals(ARGS) == []


def test_a_gpt2_config_is_the_args_of_the_gpt_that_gives_it_back() -> None:
    config = megatron_hf.hf_config({**ARGS, "bias_gelu_fusion": False, "openai_gelu": True}, dtype="float32")
    args = megatron_hf.megatron_args(config, 1, 2, 4)
    assert (args["normalization"], args["position_embedding_type"], args["swiglu"], args["add_bias_linear"],
            args["untie_embeddings_and_output_weights"], args["group_query_attention"]) == (
        "LayerNorm", "learned_absolute", False, True, False, False)
    assert (args["num_layers"], args["hidden_size"], args["ffn_hidden_size"], args["num_attention_heads"],
            args["max_position_embeddings"], args["vocab_size"]) == (2, 12, 20, 3, 8, VOCAB)
    back = megatron_hf.hf_config(args, dtype="float32")
    assert {k: back[k] for k in config if k != "vocab_size"} == {k: config[k] for k in config if k != "vocab_size"}
    assert megatron_hf.hf_refusals(config) == [] and megatron_llama.hf_refusals(config) != []


@pytest.mark.parametrize("change, said", [
    ({"activation_function": "relu"}, "the relu activation"),
    ({"scale_attn_by_inverse_layer_idx": True}, "attention scaled by the layer"),
    ({"architectures": ["GPT2DoubleHeadsModel"]}, "not GPT2LMHeadModel"),
])
def test_what_megatron_cannot_express_of_a_gpt2_is_refused_in_one_line(change: dict, said: str) -> None:
    config = {**megatron_hf.hf_config(ARGS, dtype="float32"), **change}
    with pytest.raises(ValueError, match="not supported yet as a Megatron GPT") as err:
        megatron_hf.megatron_args(config, 1, 1, 1)
    assert said in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="target.tp_size=2 does not divide the model's 3 attention heads"):
        megatron_hf.megatron_args(megatron_hf.hf_config(ARGS, dtype="float32"), 2, 1, 2)
