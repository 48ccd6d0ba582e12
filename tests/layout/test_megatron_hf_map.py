"""The map between Megatron's GPT and HF's Llama (:mod:`osdpipe.layout.megatron_hf`), without either framework.

Each map is checked on tensors whose every element is its own global index, against positions computed here head by
head (not by the module's reshapes), so a misplaced row shows; the map is a permutation of the unpadded elements;
``from_hf(to_hf(x))`` is ``x`` bit for bit but for the padding rows; what HF's Llama cannot express is refused.
That the map computes the same function is proven by both frameworks' forward passes in
``tests/frameworks/test_megatron_hf.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron_args import LLAMA_ARGS

from osdpipe.layout import megatron_llama
from osdpipe.layout.megatron import Gpt, global_shapes, query_groups
from osdpipe.layout.megatron_hf import (
    architecture,
    from_hf,
    hf_config,
    hf_shapes,
    refusals,
    titan_args,
    titan_refusals,
    to_hf,
    true_vocab_size,
)

#: The harness's GPT (tests/frameworks/mcore.py: GQA 4 heads / 2 groups), MHA, MQA, kv_channels != hidden / heads,
#: and GQA with Megatron-LM's linear biases (a Llama with attention_bias and mlp_bias) or linear_qkv's alone (a Qwen2),
#: or with its embedding tied to the output layer (a Llama with tie_word_embeddings: no lm_head.weight), or with a norm
#: on each head's query and key (qk_layernorm: a Qwen3, its head dimension other than hidden / heads as Qwen3's is).
GPTS = {
    "gqa": Gpt(num_layers=3, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, num_query_groups=2,
               kv_channels=4, padded_vocab_size=40, swiglu=True),
    "mha": Gpt(num_layers=2, hidden_size=8, ffn_hidden_size=12, num_attention_heads=2, num_query_groups=2,
               kv_channels=4, padded_vocab_size=16, swiglu=True),
    "mqa": Gpt(num_layers=2, hidden_size=12, ffn_hidden_size=8, num_attention_heads=6, num_query_groups=1,
               kv_channels=3, padded_vocab_size=24, swiglu=True),
    "wide_heads": Gpt(num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=4, num_query_groups=2,
                      kv_channels=5, padded_vocab_size=16, swiglu=True),
    "gqa_biased": Gpt(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, num_query_groups=2,
                      kv_channels=4, padded_vocab_size=40, swiglu=True, linear_bias=True),
    "gqa_qkv_bias": Gpt(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, num_query_groups=2,
                        kv_channels=4, padded_vocab_size=40, swiglu=True, qkv_bias=True),
    "gqa_tied": Gpt(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, num_query_groups=2,
                    kv_channels=4, padded_vocab_size=40, swiglu=True, tied=True),
    "gqa_qk": Gpt(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, num_query_groups=2,
                  kv_channels=6, padded_vocab_size=40, swiglu=True, qk_layernorm=True),
}
VOCAB = {"gqa": 37, "mha": 16, "mqa": 20, "wide_heads": 9, "gqa_biased": 37, "gqa_qkv_bias": 37, "gqa_tied": 37,
         "gqa_qk": 37}

#: Megatron-LM's args of the harness's GPT (tests/frameworks/mcore.py ``make_args``), the fields the map reads.
ARGS = LLAMA_ARGS


def _indexed(gpt: Gpt, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Megatron tensors whose elements are their index in one numbering of all of them (unique across keys)."""
    out, at = {}, 0
    for key, shape in global_shapes(gpt).items():
        n = math.prod(shape)
        out[key] = torch.arange(at, at + n, dtype=dtype).reshape(shape)
        at += n
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", sorted(GPTS))
def test_each_tensor_lands_where_the_heads_say(name):
    gpt, vocab = GPTS[name], VOCAB[name]
    x = _indexed(gpt)
    hf = to_hf(gpt, x, vocab)
    assert {k: tuple(v.shape) for k, v in hf.items()} == hf_shapes(gpt, vocab)
    d, f, heads, groups = gpt.kv_channels, gpt.ffn_hidden_size, gpt.num_attention_heads, gpt.num_query_groups
    per_group = heads // groups
    qkv = x["decoder.layers.self_attention.linear_qkv.weight"]
    fc1 = x["decoder.layers.mlp.linear_fc1.weight"]
    qkv_bias = x.get("decoder.layers.self_attention.linear_qkv.bias")
    fc1_bias = x.get("decoder.layers.mlp.linear_fc1.bias")
    assert (qkv_bias is not None, fc1_bias is not None) == (gpt.has_qkv_bias, gpt.linear_bias)
    assert torch.equal(hf["model.embed_tokens.weight"], x["embedding.word_embeddings.weight"][:vocab])
    if gpt.tied:  # one tensor: transformers' tied lm_head is the embedding
        assert "lm_head.weight" not in hf and "output_layer.weight" not in x
    else:
        assert torch.equal(hf["lm_head.weight"], x["output_layer.weight"][:vocab])
    assert torch.equal(hf["model.norm.weight"], x["decoder.final_layernorm.weight"])
    for i in range(gpt.num_layers):
        p = f"model.layers.{i}."
        for head in range(heads):
            group, within = divmod(head, per_group)
            first = group * (per_group + 2) * d + within * d  # group's block, then the head's d rows in it
            assert torch.equal(hf[p + "self_attn.q_proj.weight"][head * d:(head + 1) * d], qkv[i, first:first + d])
            if qkv_bias is not None:  # a bias goes with its rows
                assert torch.equal(hf[p + "self_attn.q_proj.bias"][head * d:(head + 1) * d],
                                   qkv_bias[i, first:first + d])
        for group in range(groups):
            k = group * (per_group + 2) * d + per_group * d
            assert torch.equal(hf[p + "self_attn.k_proj.weight"][group * d:(group + 1) * d], qkv[i, k:k + d])
            assert torch.equal(hf[p + "self_attn.v_proj.weight"][group * d:(group + 1) * d], qkv[i, k + d:k + 2 * d])
            if qkv_bias is not None:
                assert torch.equal(hf[p + "self_attn.k_proj.bias"][group * d:(group + 1) * d], qkv_bias[i, k:k + d])
                assert torch.equal(hf[p + "self_attn.v_proj.bias"][group * d:(group + 1) * d],
                                   qkv_bias[i, k + d:k + 2 * d])
        assert torch.equal(hf[p + "mlp.gate_proj.weight"], fc1[i, :f])
        assert torch.equal(hf[p + "mlp.up_proj.weight"], fc1[i, f:])
        assert torch.equal(hf[p + "mlp.down_proj.weight"], x["decoder.layers.mlp.linear_fc2.weight"][i])
        assert torch.equal(hf[p + "self_attn.o_proj.weight"], x["decoder.layers.self_attention.linear_proj.weight"][i])
        assert torch.equal(hf[p + "input_layernorm.weight"],
                           x["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i])
        assert torch.equal(hf[p + "post_attention_layernorm.weight"],
                           x["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i])
        if fc1_bias is not None:
            assert torch.equal(hf[p + "mlp.gate_proj.bias"], fc1_bias[i, :f])
            assert torch.equal(hf[p + "mlp.up_proj.bias"], fc1_bias[i, f:])
            assert torch.equal(hf[p + "mlp.down_proj.bias"], x["decoder.layers.mlp.linear_fc2.bias"][i])
            assert torch.equal(hf[p + "self_attn.o_proj.bias"], x["decoder.layers.self_attention.linear_proj.bias"][i])
        assert (p + "self_attn.o_proj.bias" in hf) == (p + "mlp.up_proj.bias" in hf) == gpt.linear_bias
        for which in ("q", "k"):  # one norm of d for every head: whole
            norm = x.get(f"decoder.layers.self_attention.{which}_layernorm.weight")
            assert (norm is not None) == (p + f"self_attn.{which}_norm.weight" in hf) == gpt.qk_layernorm
            if norm is not None:
                assert torch.equal(hf[p + f"self_attn.{which}_norm.weight"], norm[i]) and norm.shape[1:] == (d,)


@pytest.mark.parametrize("name", sorted(GPTS))
def test_the_map_is_a_permutation_of_the_unpadded_elements(name):
    """Every element but the vocabulary's padding rows reaches HF exactly once, and nothing else does."""
    gpt, vocab = GPTS[name], VOCAB[name]
    x = _indexed(gpt)
    kept = [t[:vocab] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else t for k, t in x.items()]
    expected = torch.cat([t.reshape(-1) for t in kept]).sort().values
    got = torch.cat([t.reshape(-1) for t in to_hf(gpt, x, vocab).values()]).sort().values
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(GPTS))
def test_roundtrip_is_bitwise(name, dtype):
    """Random tensors (NaN and -0.0 among them: a copy keeps their bits, arithmetic would not) come back bitwise;
    the padding rows come back zero."""
    gpt, vocab = GPTS[name], VOCAB[name]
    gen = torch.Generator().manual_seed(7)
    x = {k: torch.randn(s, generator=gen).to(dtype) for k, s in global_shapes(gpt).items()}
    x["decoder.final_layernorm.weight"][0] = float("nan")
    x["decoder.layers.mlp.linear_fc1.weight"][0, 0, 0] = -0.0
    hf = to_hf(gpt, x, vocab)
    assert all(t.dtype == dtype and t.is_contiguous() for t in hf.values())
    back = from_hf(gpt, hf)
    assert list(back) == list(global_shapes(gpt))
    for key, t in x.items():
        expected = t.clone()
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            expected[vocab:] = 0
        assert back[key].dtype == dtype
        assert torch.equal(_bits(back[key]), _bits(expected)), key
    assert all(torch.equal(_bits(t), _bits(hf[k])) for k, t in to_hf(gpt, back, vocab).items())


def test_to_hf_copies():
    """The HF tensors own their storage: writing to one changes neither the input nor another output."""
    gpt = GPTS["gqa"]
    x = _indexed(gpt)
    before = {k: v.clone() for k, v in x.items()}
    hf = to_hf(gpt, x, VOCAB["gqa"])
    for t in hf.values():
        t.fill_(-1)
    assert all(torch.equal(x[k], before[k]) for k in x)
    pointers = [t.untyped_storage().data_ptr() for t in hf.values()]
    assert len(set(pointers)) == len(pointers)


def test_from_hf_pads_to_another_vocabulary():
    gpt = GPTS["gqa"]
    hf = to_hf(gpt, _indexed(gpt), 37)
    back = from_hf(gpt, hf, padded_vocab=64)
    assert back["embedding.word_embeddings.weight"].shape == (64, gpt.hidden_size)
    assert torch.equal(back["output_layer.weight"][:37], hf["lm_head.weight"])
    assert not back["output_layer.weight"][37:].any()
    with pytest.raises(ValueError, match="does not fit the padded vocabulary 32"):
        from_hf(gpt, hf, padded_vocab=32)


def test_wrong_tensors_are_refused():
    gpt = GPTS["gqa"]
    x = _indexed(gpt)
    with pytest.raises(ValueError, match="missing \\['decoder.final_layernorm.weight'\\]"):
        to_hf(gpt, {k: v for k, v in x.items() if k != "decoder.final_layernorm.weight"}, 37)
    with pytest.raises(ValueError, match="linear_fc1.weight has shape"):
        to_hf(gpt, {**x, "decoder.layers.mlp.linear_fc1.weight": torch.zeros(3, 24, 16)}, 37)
    with pytest.raises(ValueError, match="vocabulary 41 is not in"):
        to_hf(gpt, x, 41)
    hf = to_hf(gpt, x, 37)
    with pytest.raises(ValueError, match="unexpected \\['model.rotary_emb.inv_freq'\\]"):
        from_hf(gpt, {**hf, "model.rotary_emb.inv_freq": torch.zeros(2)})
    with pytest.raises(ValueError, match="lm_head.weight has shape"):
        from_hf(gpt, {**hf, "lm_head.weight": torch.zeros(36, 16)})
    plain = Gpt(**{**gpt.__dict__, "swiglu": False})
    with pytest.raises(ValueError, match="an MLP without SwiGLU: not supported yet"):
        to_hf(plain, {}, 37)


def test_config_of_the_harness_gpt():
    config = hf_config(ARGS)
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta",
                                   "max_position_embeddings", "tie_word_embeddings", "torch_dtype")} == {
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 1000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 16, "tie_word_embeddings": False, "torch_dtype": "float32"}
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert hf_config({**ARGS, "bf16": True})["torch_dtype"] == "bfloat16"
    assert hf_config(ARGS, dtype="float32", vocab_size=999)["vocab_size"] == 999


def test_vocabulary_and_query_groups_from_args():
    assert true_vocab_size(ARGS) == 1000
    assert true_vocab_size({**ARGS, "vocab_size": None}) == 1024  # not recorded: the padding rows stay
    assert query_groups(ARGS) == 2
    # Without group_query_attention Megatron-LM gives every head its own group, whatever --num-query-groups says.
    assert query_groups({**ARGS, "group_query_attention": False, "num_query_groups": 1}) == 4
    assert hf_config({**ARGS, "group_query_attention": False, "num_query_groups": 1})["num_key_value_heads"] == 4
    with pytest.raises(ValueError, match="vocabulary 1025 is not in"):
        hf_config(ARGS, vocab_size=1025)


@pytest.mark.parametrize("change, feature", [
    ({"normalization": "LayerNorm"}, "LayerNorm (not RMSNorm)"),
    ({"normalization": None}, "None (not RMSNorm)"),
    ({"apply_layernorm_1p": True}, "zero-centred norm weights"),
    ({"swiglu": False}, "an MLP without SwiGLU"),
    ({"squared_relu": True, "swiglu": False}, "squared ReLU"),
    ({"num_experts": 8}, "a mixture of experts"),
    ({"position_embedding_type": "learned_absolute"}, "learned_absolute position embeddings (not rope)"),
    ({"rotary_interleaved": True}, "interleaved RoPE"),
    ({"rotary_percent": 0.5}, "partial RoPE"),
    ({"rotary_seq_len_interpolation_factor": 4}, "RoPE position interpolation"),
    ({"rope_type": "yarn"}, "the yarn RoPE type"),
    ({"qk_layernorm": True, "add_bias_linear": True}, "linear biases with qk_layernorm"),
    ({"qk_layernorm": True, "add_qkv_bias": True}, "linear biases with qk_layernorm"),
    ({"qk_layernorm": True, "use_rope_scaling": True}, "RoPE scaling with qk_layernorm"),
    ({"multi_latent_attention": True}, "multi-latent attention"),
    ({"window_size": (128, 0)}, "sliding-window attention"),
    ({"mtp_num_layers": 1}, "multi-token prediction layers"),
    ({"activation_func_clamp_value": 7.0}, "a clamped activation"),
])
def test_what_llama_cannot_express_is_refused(change, feature):
    args = {**ARGS, **change}
    assert feature in ", ".join(refusals(args))
    with pytest.raises(ValueError, match="not supported yet") as err:
        hf_config(args)
    assert feature in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("biases, architecture, flags", [
    ({"add_bias_linear": True}, "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ({"add_bias_linear": True, "add_qkv_bias": True}, "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ({"add_qkv_bias": True}, "Qwen2ForCausalLM", {"use_sliding_window": False}),
])
def test_a_biased_gpt_is_a_biased_llama_or_a_qwen2_in_a_folder_and_a_pytorch_job_and_refused_for_torchtitan(
        biases, architecture, flags):
    """A model folder and a PyTorch job's model hold the biases as transformers does (hf_config: the same model);
    torchtitan's llama3 has none, so its path refuses them in one line."""
    args = {**ARGS, **biases}
    config = hf_config(args)
    assert config["architectures"] == [architecture] and {k: config[k] for k in flags} == flags
    assert ("attention_bias" in config) == (architecture == "LlamaForCausalLM")
    assert refusals(args) == []
    assert titan_refusals(args) == ["linear biases (add_bias_linear or add_qkv_bias: torchtitan's llama3 has none)"]
    with pytest.raises(ValueError, match="torchtitan's llama3 has none"):
        titan_args(args, vocab_size=37)
    if architecture == "Qwen2ForCausalLM":  # what Qwen2 cannot take, named, for a folder and a PyTorch job alike
        assert "RoPE scaling" in ", ".join(refusals({**args, "use_rope_scaling": True}))
        assert "head dimension" in ", ".join(refusals({**args, "kv_channels": 8}))


def test_a_qk_layernorm_gpt_is_a_qwen3_in_a_folder_a_pytorch_job_and_torchtitan():
    """A norm on each head's query and key, no biases: transformers' Qwen3 (its head dimension written, as a Qwen3's
    need not be hidden / heads), and torchtitan's qwen3 (``torchtitan_qwen3``'s keywords, the head dimension its own);
    GPT-2 norms no query or key. Without head norms, torchtitan's llama3 refuses a head dimension of its own."""
    from osdpipe.layout import megatron_gpt2
    from osdpipe.layout.megatron_hf import titan_family

    args = {**ARGS, "qk_layernorm": True, "kv_channels": 24}
    config = hf_config(args)
    assert (config["architectures"], config["model_type"]) == (["Qwen3ForCausalLM"], "qwen3")
    assert config["head_dim"] == 24 and config["attention_bias"] is False and "mlp_bias" not in config
    assert (config["use_sliding_window"], config["sliding_window"]) == (False, None)
    assert refusals(args) == []
    assert titan_refusals(args) == [] and titan_family(args).factory == "torchtitan_qwen3"
    titan = titan_args(args, vocab_size=37)
    assert (titan["head_dim"], titan["dim"], titan["n_heads"]) == (24, ARGS["hidden_size"], ARGS["num_attention_heads"])
    assert titan_family({**args, "qk_layernorm": False}).factory == "torchtitan_llama3"
    assert titan_refusals({**args, "qk_layernorm": False}) == [
        f"kv_channels=24 x {ARGS['num_attention_heads']} heads other than hidden_size={ARGS['hidden_size']} "
        "(torchtitan's llama3 takes its head dimension as hidden / heads)"]
    assert "qk_layernorm" in ", ".join(megatron_gpt2.refusals({**ARGS, "normalization": "LayerNorm",
                                                               "qk_layernorm": True}))
    with pytest.raises(ValueError, match="linear biases with qk_layernorm"):  # the map refuses a layout with both
        to_hf(Gpt(**{**GPTS["gqa_qk"].__dict__, "linear_bias": True}), {}, 37)


def test_a_tied_gpt_is_a_tied_llama_in_a_folder_a_training_job_and_torchtitan():
    """A model folder and a PyTorch job's Llama hold tied embeddings as transformers does (``tie_word_embeddings``,
    no ``lm_head.weight``: one parameter); torchtitan's as its ``enable_weight_tying`` (``tie_embeddings``)."""
    args = {**ARGS, "untie_embeddings_and_output_weights": False}
    assert hf_config(args)["tie_word_embeddings"] is True and hf_config(ARGS)["tie_word_embeddings"] is False
    assert refusals(args) == []
    assert titan_refusals(args) == [] and titan_refusals(ARGS) == []
    assert titan_args(args, vocab_size=37)["tie_embeddings"] is True and "tie_embeddings" not in titan_args(
        ARGS, vocab_size=37)
    assert "lm_head.weight" not in to_hf(GPTS["gqa_tied"], {k: torch.zeros(s) for k, s in
                                                            global_shapes(GPTS["gqa_tied"]).items()}, 37)


def test_absent_args_take_megatron_lm_defaults():
    """Megatron-LM's defaults (LayerNorm, GeLU, learned absolute positions) are a GPT-2, which the Llama family
    refuses, and biases torchtitan's llama3."""
    bare = {k: ARGS[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                 "seq_length", "padded_vocab_size")}
    assert refusals(bare) == [] and architecture(bare) == "GPT2LMHeadModel"
    assert megatron_llama.refusals(bare) == ["LayerNorm (not RMSNorm)", "an MLP without SwiGLU",
                                             "learned_absolute position embeddings (not rope)"]
    assert titan_refusals(bare)[-1:] == [
        "linear biases (add_bias_linear or add_qkv_bias: torchtitan's llama3 has none)"]
    assert not refusals(ARGS)
