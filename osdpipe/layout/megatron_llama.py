"""Megatron-Core's GPT <-> Hugging Face's ``LlamaForCausalLM`` (and its kin, Qwen2 and Qwen3): the config and the
weights' map, pure functions.

A family of :mod:`osdpipe.layout.megatron_hf`'s registry (:class:`osdpipe.layout.megatron_hf.HfFamily`): the one a
Megatron GPT with RMSNorm and RoPE is written as, and the one every GPT not another family's falls to, whose refusals
then say what a Llama cannot express.

A Megatron GPT with RMSNorm, SwiGLU, RoPE (rotate-half), no biases and untied embeddings computes the function of
transformers' ``LlamaForCausalLM``; only the tensors are named and cut differently. Its embedding tied to the output
layer (Megatron-LM's ``untie_embeddings_and_output_weights`` unset) is Llama's ``tie_word_embeddings`` (Llama 3.2's 1B
and 3B, Qwen2.5's smaller models): one tensor, ``model.embed_tokens.weight``, and no ``lm_head.weight`` (transformers'
``save_pretrained`` writes none where the two are tied, and ``from_pretrained`` ties ``lm_head`` to the embedding). With
Megatron-LM's linear biases (``add_bias_linear``) it is a Llama with ``attention_bias`` and ``mlp_bias``; with
``linear_qkv``'s alone (``add_qkv_bias``) transformers' ``Qwen2ForCausalLM`` (:func:`architecture`); a bias is cut as
its weight's rows. With a norm on each head's query and key (``qk_layernorm``) and no biases it is a
``Qwen3ForCausalLM``, whose ``q_norm`` and ``k_norm`` are Megatron's ``q_layernorm`` and ``k_layernorm``. The map
(Megatron's sharded keys as :func:`osdpipe.layout.megatron.global_shapes` gives them, the decoder's layers stacked on
axis 0; ``g`` a query group of ``G``, ``n = heads / G`` query heads each, ``d`` the head
dimension, ``f`` the FFN size, ``V`` the true vocabulary and ``Vp`` Megatron's padded one):

=========================================================  ======================================================
Megatron                                                   Hugging Face (layer ``i``)
=========================================================  ======================================================
``embedding.word_embeddings.weight`` ``[Vp, h]``           ``model.embed_tokens.weight``: rows ``[0, V)``
``...linear_qkv.layer_norm_weight[i]``                     ``model.layers.{i}.input_layernorm.weight``
``...linear_qkv.weight[i]`` ``[G (n + 2) d, h]``           per group ``g``: rows ``[g(n+2)d, g(n+2)d + nd)`` ->
                                                           ``q_proj`` rows ``[g n d, (g+1) n d)``; the next ``d``
                                                           -> ``k_proj`` rows ``[g d, (g+1) d)``; the next ``d``
                                                           -> ``v_proj`` rows ``[g d, (g+1) d)``
``...linear_proj.weight[i]``                               ``model.layers.{i}.self_attn.o_proj.weight``
``...linear_fc1.layer_norm_weight[i]``                     ``model.layers.{i}.post_attention_layernorm.weight``
``...linear_fc1.weight[i]`` ``[2f, h]``                    rows ``[0, f)`` -> ``mlp.gate_proj``, ``[f, 2f)`` ->
                                                           ``mlp.up_proj``
``...linear_fc2.weight[i]``                                ``model.layers.{i}.mlp.down_proj.weight``
``decoder.final_layernorm.weight``                         ``model.norm.weight``
``output_layer.weight`` ``[Vp, h]`` (untied)               ``lm_head.weight``: rows ``[0, V)``
``...linear_qkv.bias[i]``, ``...linear_fc1.bias[i]``       as their weights' rows: ``q_proj``, ``k_proj``,
                                                           ``v_proj``, ``gate_proj``, ``up_proj`` ``.bias``
``...linear_proj.bias[i]``, ``...linear_fc2.bias[i]``      ``self_attn.o_proj.bias``, ``mlp.down_proj.bias``
``...q_layernorm.weight[i]``, ``...k_layernorm.weight[i]``  ``self_attn.q_norm.weight``, ``self_attn.k_norm.weight``
``[d]`` (``qk_layernorm``: a Qwen3)
=========================================================  ======================================================

Every element goes to exactly one place and comes back (:func:`from_hf` puts the padding rows back as zeros), with no
arithmetic: the same map carries the fp32 masters and Adam's moments.

Why each rule, in the sources installed here (megatron-core 0.16.1, transformers 5.23.0):

* **qkv.** megatron ``transformer/attention.py`` ``get_query_key_value_tensors`` (l. 1385-1460) views
  ``linear_qkv``'s output as ``[G, (n + 2) d]`` and splits each group into ``n d`` query, ``d`` key, ``d`` value
  columns; the queries become heads ``g n .. g n + n - 1``. ``transformer/dot_product_attention.py`` l. 170-175
  repeats each key/value head ``n`` times (``repeat_interleave``): query head ``j`` reads group ``j // n``.
  transformers ``models/llama/modeling_llama.py`` ``repeat_kv`` (l. 168-177) pairs query head ``j`` with key/value
  head ``j // n`` too, its heads being ``q_proj``'s consecutive blocks of ``d`` rows (l. 243-245). Hence the
  per-group cut above and no reordering of heads.
* **RoPE.** megatron ``models/common/embeddings/rotary_pos_embedding.py`` l. 79-81 (``inv_freq = 1 / base **
  (arange(0, d, 2) / d)``) and l. 167-168 (``cat((freqs, freqs))`` when not ``rotary_interleaved``),
  ``rope_utils.py`` ``_rotate_half`` l. 82-84 (``cat((-x2, x1))`` of the two halves) and l. 125
  (``t cos + rotate_half(t) sin``). transformers ``modeling_llama.py`` l. 105 (the same ``inv_freq``), l. 112
  (``cat((freqs, freqs))``), ``rotate_half`` l. 119-123 and ``apply_rotary_pos_emb`` l. 147. The same convention
  (rotate-half over the whole head), so q and k need no permutation (unlike Meta's interleaved checkpoints).
  ``rotary_interleaved``, ``rotary_percent < 1`` and RoPE scaling are refused.
* **Attention scale.** megatron ``dot_product_attention.py`` l. 84-85 ``1 / sqrt(d)``; transformers l. 215
  ``head_dim ** -0.5``; ``head_dim`` is written explicitly (``kv_channels`` need not be ``hidden / heads``).
* **SwiGLU.** megatron ``transformer/mlp.py`` ``glu`` l. 219-224: ``linear_fc1``'s output is chunked in two,
  ``silu(first) * second``; transformers ``LlamaMLP.forward`` l. 164: ``down(silu(gate(x)) * up(x))``. So the
  first ``f`` rows are ``gate_proj``, the last ``f`` ``up_proj`` (globally ``[gate; up]`` whatever the TP:
  :mod:`osdpipe.layout.megatron`).
* **RMSNorm.** megatron's local spec builds ``torch.nn.RMSNorm(h, eps)`` (``transformer/torch_norm.py`` l. 40-45):
  ``x / sqrt(mean(x^2) + eps) * w``; transformers ``LlamaRMSNorm`` l. 52-66 the same (in fp32). ``eps`` is
  ``norm_epsilon``.
* **qk_layernorm.** megatron ``transformer/attention.py`` ``SelfAttention.__init__`` builds ``q_layernorm`` and
  ``k_layernorm`` of the head dimension ``d`` with ``layernorm_epsilon`` (the local spec's norm: ``torch.nn.RMSNorm``
  under RMSNorm), and ``get_query_key_value_tensors`` applies them to the ``[s, b, heads, d]`` queries and keys, one
  weight for every head, before ``forward`` applies RoPE. transformers ``models/qwen3/modeling_qwen3.py``
  ``Qwen3Attention`` (l. 229-249): ``q_norm``/``k_norm`` are ``Qwen3RMSNorm(head_dim, rms_norm_eps)`` on each head of
  ``q_proj``'s and ``k_proj``'s output, then ``apply_rotary_pos_emb``. The same norm at the same place: the weights
  map whole. Qwen3's ``attention_bias`` biases ``o_proj`` with q, k and v and its MLP has none, which no Megatron
  bias option gives: a Qwen3 has no biases here.
* **Logits.** megatron ``models/gpt/gpt_model.py`` l. 712 returns ``[b, s, Vp]``; the ``Vp - V`` padding rows'
  logits belong to no token, and HF's ``lm_head`` is ``V`` rows (``modeling_llama.py`` l. 420).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from osdpipe.layout import llama_titan
from osdpipe.layout.llama_titan import TitanFamily
from osdpipe.layout.maps import Map, rows
from osdpipe.layout.megatron import (
    GROUPS,
    LAYERS,
    Gpt,
    block_refusals,
    check_shapes,
    global_shapes,
    grid_args,
    position_embedding_type,
    query_groups,
    save_args,
    tied_embeddings,
    tied_word_embeddings,
)
from osdpipe.layout.ranges import Segment

EMBEDDING = "embedding.word_embeddings.weight"
QKV = f"{LAYERS}self_attention.linear_qkv.weight"
INPUT_NORM = f"{LAYERS}self_attention.linear_qkv.layer_norm_weight"
PROJ = f"{LAYERS}self_attention.linear_proj.weight"
FC1 = f"{LAYERS}mlp.linear_fc1.weight"
MLP_NORM = f"{LAYERS}mlp.linear_fc1.layer_norm_weight"
FC2 = f"{LAYERS}mlp.linear_fc2.weight"
QKV_BIAS = f"{LAYERS}self_attention.linear_qkv.bias"
PROJ_BIAS = f"{LAYERS}self_attention.linear_proj.bias"
FC1_BIAS = f"{LAYERS}mlp.linear_fc1.bias"
FC2_BIAS = f"{LAYERS}mlp.linear_fc2.bias"
Q_NORM = f"{LAYERS}self_attention.q_layernorm.weight"
K_NORM = f"{LAYERS}self_attention.k_layernorm.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"

#: Megatron key of a per-layer tensor taken whole -> the HF name within ``model.layers.{i}.`` (the biases where the
#: GPT has them, and a Qwen3's head norms: :func:`_whole_per_layer`).
_WHOLE_PER_LAYER = {
    INPUT_NORM: "input_layernorm.weight",
    PROJ: "self_attn.o_proj.weight",
    PROJ_BIAS: "self_attn.o_proj.bias",
    Q_NORM: "self_attn.q_norm.weight",
    K_NORM: "self_attn.k_norm.weight",
    MLP_NORM: "post_attention_layernorm.weight",
    FC2: "mlp.down_proj.weight",
    FC2_BIAS: "mlp.down_proj.bias",
}

#: The Hugging Face architectures a Megatron GPT is written as (:func:`architecture`).
LLAMA, QWEN2, QWEN3 = "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
#: Each architecture's ``model_type`` in its ``config.json``.
MODEL_TYPES = {LLAMA: "llama", QWEN2: "qwen2", QWEN3: "qwen3"}
#: The ``model.factory`` of transformers' Llama (or Qwen2, Qwen3) of a ``config.json``'s keys.
HF_FACTORY = "hf_llama"
HF_EMBEDDING = "model.embed_tokens.weight"


def fits_args(args: dict[str, Any]) -> bool:
    """Every GPT falls to the Llama family that no other family takes: :func:`refusals` says what of it a Llama cannot
    express."""
    return True


def fits_config(config: dict[str, Any]) -> bool:
    """Every ``config.json`` no other family takes is read as a Llama's: :func:`hf_refusals` names what is not."""
    return True


def fits_gpt(gpt: Gpt) -> bool:
    """Every GPT layout no other family takes is mapped as a Llama's: the maps refuse what a Llama has not."""
    return True


def architecture(args: dict[str, Any]) -> str:
    """The Hugging Face model of this family that computes the GPT Megatron-LM's ``args`` describe: Qwen3's where each
    head's query and key are normed (``qk_layernorm``), Qwen2's where only ``linear_qkv`` has a bias (``add_qkv_bias``:
    Qwen2 biases q, k and v, not o, nor its MLP), else Llama's (``add_bias_linear``, a bias on each of the four
    linears, is Llama's ``attention_bias`` and ``mlp_bias``)."""
    if args.get("qk_layernorm"):
        return QWEN3
    return QWEN2 if args.get("add_qkv_bias") and not args.get("add_bias_linear") else LLAMA


def _split_by_rows(gpt: Gpt) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The Megatron keys HF splits by rows, each with the kind (``weight``, ``bias``) of the HF names it goes to:
    ``linear_qkv``'s (per query group into q, k and v) and ``linear_fc1``'s (into gate and up), a bias where the GPT
    has one (:func:`to_hf` and :func:`from_hf` walk the same list)."""
    qkv = [(QKV, "weight")] + ([(QKV_BIAS, "bias")] if gpt.has_qkv_bias else [])
    fc1 = [(FC1, "weight")] + ([(FC1_BIAS, "bias")] if gpt.linear_bias else [])
    return qkv, fc1


def _whole_per_layer(gpt: Gpt) -> dict[str, str]:
    shapes = global_shapes(gpt)
    return {key: name for key, name in _WHOLE_PER_LAYER.items() if key in shapes}


def refusals(args: dict[str, Any]) -> list[str]:
    """What of the GPT ``args`` describe HF's Llama (or Qwen2: :func:`architecture`) cannot express (empty: nothing).
    Absent args take Megatron-LM's defaults (LayerNorm, GeLU, learned absolute positions, biases on, embeddings tied):
    a GPT-2, which a model folder holds as another family's (:mod:`osdpipe.layout.megatron_gpt2`).

    A model folder and a PyTorch job's model (a training checkpoint's) are the same transformers model: a GPT's linear
    biases are Llama's ``attention_bias`` and ``mlp_bias`` or, ``linear_qkv``'s alone, a Qwen2; tied embeddings are
    ``tie_word_embeddings`` (one parameter, which a PyTorch job's optimizer holds once). A torchtitan job's model
    takes no biases: :func:`titan_refusals`."""
    norm, positions = args.get("normalization", "LayerNorm"), position_embedding_type(args)
    qwen2, qwen3 = architecture(args) == QWEN2, architecture(args) == QWEN3
    hidden, heads = int(args.get("hidden_size") or 0), int(args.get("num_attention_heads") or 1)
    checks = [
        (norm != "RMSNorm", f"{norm} (not RMSNorm)"),
        (not args.get("swiglu"), "an MLP without SwiGLU"),
        (qwen3 and bool(args.get("add_bias_linear") or args.get("add_qkv_bias")),
         "linear biases with qk_layernorm (a Qwen3's linears have none)"),
        (qwen3 and bool(args.get("use_rope_scaling")), "RoPE scaling with qk_layernorm (a Qwen3)"),
        (qwen2 and bool(args.get("use_rope_scaling")), "RoPE scaling with linear_qkv's bias alone (a Qwen2)"),
        (qwen2 and int(args.get("kv_channels") or hidden // heads) * heads != hidden,
         "a head dimension other than hidden / heads with linear_qkv's bias alone (a Qwen2)"),
        (positions != "rope", f"{positions} position embeddings (not rope)"),
        (bool(args.get("rotary_interleaved")), "interleaved RoPE (rotary_interleaved)"),
        (float(args.get("rotary_percent", 1.0)) != 1.0, "partial RoPE (rotary_percent != 1)"),
        (args.get("rotary_seq_len_interpolation_factor") not in (None, 1),
         "RoPE position interpolation (rotary_seq_len_interpolation_factor)"),
        (args.get("rope_type") not in (None, "rope"), f"the {args.get('rope_type')} RoPE type"),
        (args.get("no_rope_freq") is not None, "layers without RoPE (no_rope_freq)"),
        (bool(args.get("heterogeneous_layers_config_path") or args.get("heterogeneous_layers_config_encoded_json")),
         "heterogeneous layers"),
        (bool(args.get("is_hybrid_model")), "a hybrid (Mamba) model"),
    ]
    return [what for bad, what in checks if bad] + block_refusals(args)


def _refuse(what: list[str]) -> None:
    if what:
        raise ValueError(f"a Megatron GPT with {', '.join(what)}: not supported yet as a Hugging Face Llama")


#: Llama 3.1's RoPE scaling as megatron-core 0.16.1 applies it (``--use-rope-scaling``, ``--rope-scaling-factor``):
#: ``models/common/embeddings/rotary_pos_embedding.py`` ``_apply_scaling`` fixes these three.
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_config(args: dict[str, Any], *, vocab_size: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of the ``LlamaForCausalLM`` that computes the GPT Megatron-LM's ``args`` describe, or of
    the ``Qwen2ForCausalLM`` where only ``linear_qkv`` has a bias (:func:`architecture`), for ``vocab_size`` tokens
    with weights of ``dtype``.

    ``--use-rope-scaling`` is transformers' ``llama3`` rope type (the same formula: transformers
    ``_compute_llama3_parameters``, megatron-core ``_apply_scaling``, with its fixed frequency factors and positions).
    RoPE's base is written both as transformers 5's ``rope_parameters`` and as the older top-level ``rope_theta``, the
    dtype as ``dtype`` and ``torch_dtype``, so that transformers 4 and 5 read the same model.
    ``bos_token_id``/``eos_token_id`` are the tokenizer's and Megatron's ``args`` do not hold them: they are ``None``.

    Raises:
        ValueError: one line naming what HF's Llama cannot express (:func:`refusals`), "not supported yet".
    """
    _refuse(refusals(args))
    linear_bias, arch = bool(args.get("add_bias_linear")), architecture(args)
    heads, hidden = int(args["num_attention_heads"]), int(args["hidden_size"])
    theta = float(args.get("rotary_base", 10000))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if (factor := _rope_scaling_factor(args)) is not None:  # Llama 3.1's, as megatron-core applies it
        rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, **_MEGATRON_LLAMA3}
    config = {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "hidden_size": hidden,
        "intermediate_size": int(args["ffn_hidden_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": query_groups(args),
        "head_dim": int(args.get("kv_channels") or hidden // heads),
        "num_hidden_layers": int(args["num_layers"]),
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": float(args.get("norm_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_parameters": rope,
        "max_position_embeddings": int(args.get("max_position_embeddings") or args["seq_length"]),
        "tie_word_embeddings": tied_embeddings(args),
        "attention_bias": linear_bias,
        "mlp_bias": linear_bias,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if arch != LLAMA:  # Qwen2's biases are its architecture's (q, k, v), Qwen3 has none (refusals); full attention
        del config["mlp_bias"]
        config.update(llama_titan.full_attention(int(args["num_layers"])))
    if arch == QWEN2:
        del config["attention_bias"]
    return config


def titan_family(args: dict[str, Any]) -> TitanFamily:
    """The torchtitan model the GPT ``args`` describe becomes: qwen3 where it norms each head's query and key
    (``qk_layernorm``: a Qwen3), else llama3."""
    return llama_titan.QWEN3 if args.get("qk_layernorm") else llama_titan.LLAMA3


def titan_refusals(args: dict[str, Any]) -> list[str]:
    """What of the GPT ``args`` describe its torchtitan model (:func:`titan_family`) cannot express: what a Llama or a
    Qwen3 cannot (:func:`refusals`), linear biases (the linears of torchtitan's llama3 and qwen3 have none), and for
    llama3 a head dimension other than ``hidden / heads`` (qwen3 takes its own). Tied embeddings are its
    ``enable_weight_tying`` (:func:`titan_args`)."""
    family = titan_family(args)
    biased = bool(args.get("add_bias_linear", True)) or bool(args.get("add_qkv_bias"))
    hidden, heads = int(args.get("hidden_size") or 0), int(args.get("num_attention_heads") or 1)
    own_head_dim = int(args.get("kv_channels") or hidden // heads) * heads != hidden
    checks = [
        (biased, f"linear biases (add_bias_linear or add_qkv_bias: torchtitan's {family.name} has none)"),
        (own_head_dim and not family.own_head_dim,
         f"kv_channels={args.get('kv_channels')} x {heads} heads other than hidden_size={hidden} (torchtitan's "
         f"{family.name} takes its head dimension as hidden / heads)"),
    ]
    return refusals(args) + [what for bad, what in checks if bad]


def titan_args(args: dict[str, Any], *, vocab_size: int) -> dict[str, Any]:
    """The keywords of the factory of the torchtitan model (:func:`titan_family`: ``torchtitan_llama3`` or
    ``torchtitan_qwen3`` of :mod:`osdpipe.layout.models`) for the GPT Megatron-LM's ``args`` describe: the same model
    as :func:`hf_config`'s (:mod:`osdpipe.layout.llama_titan` maps one's tensors to the other's).

    Raises:
        ValueError: what the torchtitan model cannot express (:func:`titan_refusals`).
    """
    what = titan_refusals(args)
    if what:
        raise ValueError(f"a Megatron GPT with {', '.join(what)}: not supported yet as torchtitan's "
                         f"{titan_family(args).name}")
    hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    out = {
        "dim": hidden, "n_layers": int(args["num_layers"]), "n_heads": heads, "n_kv_heads": query_groups(args),
        "hidden_dim": int(args["ffn_hidden_size"]), "vocab_size": int(vocab_size),
        "norm_eps": float(args.get("norm_epsilon", 1e-5)), "rope_theta": float(args.get("rotary_base", 10000)),
        "max_seq_len": int(args.get("max_position_embeddings") or args.get("seq_length") or 4096),
    }
    if titan_family(args).own_head_dim:
        out["head_dim"] = int(args.get("kv_channels") or hidden // heads)
    if tied_embeddings(args):
        out["tie_embeddings"] = True
    if (factor := _rope_scaling_factor(args)) is not None:  # torchtitan's "llama" scaling: the same formula
        out["rope_scaling"] = {"scaling_factor": factor, **{k: float(v) for k, v in _MEGATRON_LLAMA3.items()}}
    return out


def _rope_scaling_factor(args: dict[str, Any]) -> float | None:
    """Llama 3.1's RoPE scaling factor of a GPT saved with ``--use-rope-scaling`` (``None``: unscaled). megatron-core
    applies it with :data:`_MEGATRON_LLAMA3`'s fixed frequency factors and positions."""
    if not args.get("use_rope_scaling"):
        return None
    return float(args.get("rope_scaling_factor") or 8.0)


def _check_gpt(gpt: Gpt) -> None:
    what = []
    if not gpt.swiglu:
        what.append("an MLP without SwiGLU")
    if gpt.position_table:
        what.append("a learned position table (not rope)")
    if gpt.num_attention_heads % gpt.num_query_groups:
        what.append(f"{gpt.num_attention_heads} heads in {gpt.num_query_groups} query groups")
    if gpt.qk_layernorm and (gpt.linear_bias or gpt.has_qkv_bias):
        what.append("linear biases with qk_layernorm (a Qwen3's linears have none)")
    _refuse(what)


def hf_shapes(gpt: Gpt, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``: :func:`architecture`)
    state dict :func:`to_hf` gives, and its shape, in transformers' ``named_parameters()`` order (a decoder layer's
    attention, a Qwen3's head norms after its projections, its MLP, its two norms; each linear's bias, where the GPT
    has one, after its weight): the order a PyTorch optimizer's state follows
    (:func:`osdpipe.io.hf_folder.model_from_config` builds the model's tree from it)."""
    h, d, f = gpt.hidden_size, gpt.kv_channels, gpt.ffn_hidden_size
    q, kv, o = gpt.num_attention_heads * d, gpt.num_query_groups * d, gpt.linear_bias
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(gpt.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": ((q, h), True), "self_attn.q_proj.bias": ((q,), gpt.has_qkv_bias),
            "self_attn.k_proj.weight": ((kv, h), True), "self_attn.k_proj.bias": ((kv,), gpt.has_qkv_bias),
            "self_attn.v_proj.weight": ((kv, h), True), "self_attn.v_proj.bias": ((kv,), gpt.has_qkv_bias),
            "self_attn.o_proj.weight": ((h, q), True), "self_attn.o_proj.bias": ((h,), o),
            "self_attn.q_norm.weight": ((d,), gpt.qk_layernorm), "self_attn.k_norm.weight": ((d,), gpt.qk_layernorm),
            "mlp.gate_proj.weight": ((f, h), True), "mlp.gate_proj.bias": ((f,), o),
            "mlp.up_proj.weight": ((f, h), True), "mlp.up_proj.bias": ((f,), o),
            "mlp.down_proj.weight": ((h, f), True), "mlp.down_proj.bias": ((h,), o),
            "input_layernorm.weight": ((h,), True), "post_attention_layernorm.weight": ((h,), True),
        }
        out.update({p + name: shape for name, (shape, held) in layer.items() if held})
    out["model.norm.weight"] = (h,)
    if not gpt.tied:
        out["lm_head.weight"] = (vocab_size, h)
    return out


def hf_names_of(gpt: Gpt) -> dict[str, list[str]]:
    """Each Megatron key of :func:`osdpipe.layout.megatron.global_shapes` -> the ``LlamaForCausalLM`` names its
    elements go to under :func:`to_hf`, in the state dict's order: what puts a Megatron param group's keys into the
    Llama names of the same group."""
    by_key: dict[str, list[str]] = {key: [] for key in global_shapes(gpt)}
    for name in hf_shapes(gpt, 1):
        by_key[_megatron_key_of(name)].append(name)
    return by_key


def _megatron_key_of(name: str) -> str:
    """The Megatron key a ``LlamaForCausalLM`` name's elements come from (the module docstring's table)."""
    fixed = {"model.embed_tokens.weight": EMBEDDING, "model.norm.weight": FINAL_NORM, "lm_head.weight": OUTPUT}
    if name in fixed:
        return fixed[name]
    within = name.split(".", 3)[3]  # model.layers.{i}.<within>
    bias = within.endswith(".bias")
    if within.startswith("self_attn.") and within.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
        return QKV_BIAS if bias else QKV
    if within.split(".")[:2] in (["mlp", "gate_proj"], ["mlp", "up_proj"]):
        return FC1_BIAS if bias else FC1
    return next(key for key, hf in _WHOLE_PER_LAYER.items() if hf == within)


def to_hf(gpt: Gpt, tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Megatron's GPT tensors (every key of :func:`osdpipe.layout.megatron.global_shapes`, layers stacked) -> the
    ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) state dict (module docstring's table), the
    vocabulary cut to its first ``vocab_size`` rows.

    A pure rearrangement: every output element is an input element, copied (the outputs own their storage, each
    contiguous, as ``safetensors`` wants), so the same call maps fp32 masters and Adam's moments.
    """
    _check_gpt(gpt)
    if not 0 < vocab_size <= gpt.padded_vocab_size:
        raise ValueError(f"vocabulary {vocab_size} is not in (0, padded vocabulary {gpt.padded_vocab_size}]")
    check_shapes(tensors, global_shapes(gpt), "Megatron GPT tensors")
    n, d, f = gpt.num_attention_heads // gpt.num_query_groups, gpt.kv_channels, gpt.ffn_hidden_size
    out = {"model.embed_tokens.weight": tensors[EMBEDDING][:vocab_size].clone()}
    cuts, halves = _split_by_rows(gpt)
    for i in range(gpt.num_layers):
        p = f"model.layers.{i}."
        for key, kind in cuts:  # a bias is cut as its weight's rows
            tail = tuple(tensors[key].shape[2:])  # (h,) of the weight, () of the bias
            qkv = tensors[key][i].reshape(gpt.num_query_groups, n + 2, d, *tail)
            out[f"{p}self_attn.q_proj.{kind}"] = qkv[:, :n].reshape(gpt.num_attention_heads * d, *tail).clone()
            out[f"{p}self_attn.k_proj.{kind}"] = qkv[:, n].reshape(gpt.num_query_groups * d, *tail).clone()
            out[f"{p}self_attn.v_proj.{kind}"] = qkv[:, n + 1].reshape(gpt.num_query_groups * d, *tail).clone()
        for key, kind in halves:
            out[f"{p}mlp.gate_proj.{kind}"] = tensors[key][i][:f].clone()
            out[f"{p}mlp.up_proj.{kind}"] = tensors[key][i][f:].clone()
        for key, name in _whole_per_layer(gpt).items():
            out[p + name] = tensors[key][i].clone()
    out["model.norm.weight"] = tensors[FINAL_NORM].clone()
    if not gpt.tied:
        out["lm_head.weight"] = tensors[OUTPUT][:vocab_size].clone()
    return {key: out[key] for key in hf_shapes(gpt, vocab_size)}


def hf_map(gpt: Gpt, vocab_size: int) -> Map:
    """:func:`to_hf` as data (:mod:`osdpipe.layout.maps`): each ``LlamaForCausalLM`` (Qwen2, Qwen3) parameter as the
    ranges of Megatron's GPT tensors (layers stacked) it is made of, the module docstring's table row by row; the
    vocabulary's first ``vocab_size`` rows. :func:`osdpipe.layout.maps.invert` gives :func:`from_hf`'s, the padding
    rows padding."""
    _check_gpt(gpt)
    if not 0 < vocab_size <= gpt.padded_vocab_size:
        raise ValueError(f"vocabulary {vocab_size} is not in (0, padded vocabulary {gpt.padded_vocab_size}]")
    shapes = global_shapes(gpt)
    n, d, f, g = gpt.num_attention_heads // gpt.num_query_groups, gpt.kv_channels, gpt.ffn_hidden_size, \
        gpt.num_query_groups
    h = gpt.hidden_size
    out: Map = {"model.embed_tokens.weight": (rows(EMBEDDING, 0, vocab_size, h, 0),)}
    cuts, halves = _split_by_rows(gpt)
    for i in range(gpt.num_layers):
        p = f"model.layers.{i}."
        for key, kind in cuts:  # per query group: its query heads, then a key and a value head
            per, width = shapes[key][1], math.prod(shapes[key][2:])
            at = i * per
            out[f"{p}self_attn.q_proj.{kind}"] = tuple(rows(key, at + j * (n + 2) * d, n * d, width, j * n * d)
                                                      for j in range(g))
            out[f"{p}self_attn.k_proj.{kind}"] = tuple(rows(key, at + (j * (n + 2) + n) * d, d, width, j * d)
                                                      for j in range(g))
            out[f"{p}self_attn.v_proj.{kind}"] = tuple(rows(key, at + (j * (n + 2) + n + 1) * d, d, width, j * d)
                                                      for j in range(g))
        for key, kind in halves:  # [gate; up]
            width = math.prod(shapes[key][2:])
            out[f"{p}mlp.gate_proj.{kind}"] = (rows(key, i * 2 * f, f, width, 0),)
            out[f"{p}mlp.up_proj.{kind}"] = (rows(key, i * 2 * f + f, f, width, 0),)
        for key, name in _whole_per_layer(gpt).items():
            layer = math.prod(shapes[key][1:])
            out[p + name] = (Segment(key, i * layer, layer, 0),)
    out["model.norm.weight"] = (Segment(FINAL_NORM, 0, h, 0),)
    if not gpt.tied:
        out["lm_head.weight"] = (rows(OUTPUT, 0, vocab_size, h, 0),)
    return {key: out[key] for key in hf_shapes(gpt, vocab_size)}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def from_hf(gpt: Gpt, tensors: dict[str, torch.Tensor], padded_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_hf`: a ``LlamaForCausalLM`` state dict -> Megatron's GPT tensors (layers stacked),
    the embedding and the output layer padded with zero rows to ``padded_vocab`` (default ``gpt``'s).

    ``from_hf(gpt, to_hf(gpt, x, V))`` is ``x`` bit for bit, but for the padding rows, which come back zero.
    """
    _check_gpt(gpt)
    padded = gpt.padded_vocab_size if padded_vocab is None else int(padded_vocab)
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError("Hugging Face Llama tensors: missing model.embed_tokens.weight")
    vocab = int(tensors["model.embed_tokens.weight"].shape[0])
    if vocab > padded:
        raise ValueError(f"vocabulary {vocab} does not fit the padded vocabulary {padded}")
    check_shapes(tensors, hf_shapes(gpt, vocab), "Hugging Face Llama tensors")
    n, d, g = gpt.num_attention_heads // gpt.num_query_groups, gpt.kv_channels, gpt.num_query_groups
    cuts, halves = _split_by_rows(gpt)
    whole = _whole_per_layer(gpt)
    layers: dict[str, list[torch.Tensor]] = {key: [] for key in [*dict(cuts), *dict(halves), *whole]}
    for i in range(gpt.num_layers):
        p = f"model.layers.{i}."
        for key, kind in cuts:  # per query group: its query heads, then a key and a value head
            q, k, v = (tensors[f"{p}self_attn.{proj}.{kind}"] for proj in ("q_proj", "k_proj", "v_proj"))
            tail = tuple(q.shape[1:])
            heads = [q.reshape(g, n, d, *tail), k.reshape(g, 1, d, *tail), v.reshape(g, 1, d, *tail)]
            layers[key].append(torch.cat(heads, dim=1).reshape(gpt.qkv_rows, *tail))
        for key, kind in halves:
            layers[key].append(torch.cat([tensors[f"{p}mlp.gate_proj.{kind}"], tensors[f"{p}mlp.up_proj.{kind}"]]))
        for key, name in whole.items():
            layers[key].append(tensors[p + name])
    out = {
        EMBEDDING: _pad_rows(tensors["model.embed_tokens.weight"], padded),
        **{key: torch.stack(ts) for key, ts in layers.items()},
        FINAL_NORM: tensors["model.norm.weight"].clone(),
        **({} if gpt.tied else {OUTPUT: _pad_rows(tensors["lm_head.weight"], padded)}),
    }
    return {key: out[key] for key in global_shapes(gpt)}


# ----------------------------------------------------------------------------------------------------------------------
# Hugging Face Llama -> Megatron GPT: the config.


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE's settings as transformers 5 (``rope_parameters``) or 4 (``rope_theta``, ``rope_scaling``) write them."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling:  # transformers 4's: a scaling there is one, whatever else is said
        params = {**params, **scaling, "rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def _megatrons_llama3(rope: dict[str, Any]) -> float | None:
    """The scaling factor of a ``llama3`` rope type megatron-core applies the same (``None``: it fixes other
    frequency factors or positions than this one has)."""
    fixed = all(float(rope.get(k, v)) == v for k, v in _MEGATRON_LLAMA3.items())
    return float(rope.get("factor", 8.0)) if fixed else None


def hf_refusals(config: dict[str, Any]) -> list[str]:
    """What of a Hugging Face ``config.json`` a Megatron GPT with the local layer spec cannot express (empty:
    nothing), a model folder's or a PyTorch job's (the HF Trainer's, accelerate's) alike: it must be a Llama
    (``model_type`` llama, ``LlamaForCausalLM``) with ``attention_bias`` and ``mlp_bias`` both or neither (Megatron
    biases all four linears or ``linear_qkv`` alone: ``add_bias_linear``), a Qwen2 (``Qwen2ForCausalLM``:
    ``add_qkv_bias``) or a Qwen3 without biases (``Qwen3ForCausalLM``: ``qk_layernorm``), either without sliding
    windows or RoPE scaling; with SiLU, plain RoPE, and as many query heads per key/value head in every group; its
    embeddings tied or not (``tie_word_embeddings``: Megatron's tied embedding, :func:`megatron_args`)."""
    by_type = {kind: arch for arch, kind in MODEL_TYPES.items()}
    arch = config.get("architectures") or [by_type.get(config.get("model_type"), LLAMA)]  # none: its type's
    rope = _rope_parameters(config)
    heads = int(config.get("num_attention_heads") or 0)
    groups = int(config.get("num_key_value_heads") or heads)
    known = len(arch) == 1 and MODEL_TYPES.get(arch[0]) == config.get("model_type")
    qwen2, qwen3 = known and arch == [QWEN2], known and arch == [QWEN3]
    attention, mlp = bool(config.get("attention_bias")), bool(config.get("mlp_bias"))
    hidden = int(config.get("hidden_size") or 0)
    checks = [
        (not known,
         f"model_type {config.get('model_type')!r} ({', '.join(map(str, arch))}), not a LlamaForCausalLM, "
         "Qwen2ForCausalLM or Qwen3ForCausalLM"),
        (known and arch == [LLAMA] and attention != mlp,
         "attention biases without MLP biases or the other way (Megatron biases all four linears or linear_qkv alone)"),
        (qwen3 and attention, "attention_bias in a Qwen3 (o_proj biased with q, k and v, the MLP not: no Megatron "
                              "bias option is that)"),
        ((qwen2 or qwen3) and bool(config.get("use_sliding_window")), "sliding-window attention (use_sliding_window)"),
        ((qwen2 or qwen3) and rope.get("rope_type", rope.get("type", "default")) != "default",
         f"RoPE scaling in a {arch[0].removesuffix('ForCausalLM')}"),
        (qwen2 and heads > 0 and int(config.get("head_dim") or hidden // heads) * heads != hidden,
         "a head dimension other than hidden / heads in a Qwen2"),
        (config.get("hidden_act", "silu") != "silu", f"the {config.get('hidden_act')} activation (not silu)"),
        (rope.get("rope_type", rope.get("type", "default")) not in ("default", "llama3") or (
            rope.get("rope_type") == "llama3" and _megatrons_llama3(rope) is None),
         "RoPE scaling other than Llama 3.1's with megatron-core's fixed frequency factors 1 and 4 and 8192 positions "
         "(rope_parameters)"),
        (int(config.get("pretraining_tp") or 1) != 1, "pretraining_tp != 1"),
        (heads <= 0 or groups <= 0 or heads % groups != 0,
         f"{heads} attention heads in {groups} key/value heads"),
    ]
    return [what for bad, what in checks if bad]


def megatron_args(config: dict[str, Any], tp: int, pp: int, world: int, *, iteration: int, sharding: str,
                  divisible_by: int, vpp: int = 1) -> dict[str, Any]:
    """The Megatron-LM ``args`` (``common.pt``) of the GPT that computes the Hugging Face ``LlamaForCausalLM`` (or
    ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) of ``config`` (its ``config.json``), for TP ``tp`` x PP
    ``pp`` on ``world`` ranks (``vpp`` model chunks per stage), at ``iteration``, its optimizer saved as
    ``sharding``, the vocabulary padded to a multiple of ``divisible_by`` x TP: the inverse of :func:`hf_config`
    (the defaults are :func:`osdpipe.layout.megatron_hf.megatron_args`'s).

    What Megatron-LM's ``load_checkpoint`` and osdpipe's own reader need: the GPT's dimensions (``num_query_groups``
    with ``group_query_attention`` where there are fewer key/value heads than heads), RMSNorm, SwiGLU, RoPE with
    ``rotary_base``, the biases (``add_bias_linear`` for a Llama's ``attention_bias`` and ``mlp_bias``,
    ``add_qkv_bias`` for a Qwen2: :func:`hf_refusals`), a Qwen3's ``qk_layernorm``, tied or untied embeddings, the local
    layer spec, the true ``vocab_size`` (the NullTokenizer's, as Megatron-LM records it for ``--vocab-size``) and
    ``padded_vocab_size`` (:func:`osdpipe.layout.megatron.padded_vocab_size`), the parallelism, the distributed
    optimizer, ``torch_dist``.

    Raises:
        ValueError: one line: what Megatron cannot express (:func:`hf_refusals`), "not supported yet"; or a TP that
            does not divide the heads, the query groups or the FFN, a PP that does not divide the layers, a world
            that is no multiple of TP x PP.
    """
    what = hf_refusals(config)
    if what:
        raise ValueError(f"a Hugging Face model with {', '.join(what)}: not supported yet as a Megatron GPT")
    kind = config.get("model_type")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        ffn, layers = int(config["intermediate_size"]), int(config["num_hidden_layers"])
        vocab = int(config["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"config.json holds no {exc.args[0]}, which a Llama's config has") from None
    head_dim = int(config.get("head_dim") or hidden // heads)
    sizes = ((heads, "attention heads"), (groups, GROUPS), (ffn, "intermediate_size"))
    grid = grid_args(sizes, layers, tp, pp, world, vpp)
    positions = int(config.get("max_position_embeddings") or 4096)
    rope = _rope_parameters(config)
    theta, scaling = float(rope["rope_theta"]), _megatrons_llama3(rope) if rope.get("rope_type") == "llama3" else None
    return {
        **grid,
        # the model
        "num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
        "group_query_attention": groups != heads, "num_query_groups": groups, "kv_channels": head_dim,
        "seq_length": positions, "max_position_embeddings": positions, "normalization": "RMSNorm",
        "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)), "apply_layernorm_1p": False, "swiglu": True,
        "squared_relu": False, "position_embedding_type": "rope", "use_rotary_position_embeddings": True,
        "add_position_embedding": False, "rotary_base": int(theta) if theta.is_integer() else theta,
        "rotary_percent": 1.0, "rotary_interleaved": False, "use_rope_scaling": scaling is not None,
        "rope_scaling_factor": scaling or 8.0,
        "untie_embeddings_and_output_weights": not tied_word_embeddings(config),
        "add_bias_linear": bool(config.get("attention_bias")) and kind == "llama", "add_qkv_bias": kind == "qwen2",
        "qk_layernorm": kind == "qwen3", "num_experts": None, "transformer_impl": "local",
        "hidden_dropout": 0.0, "attention_dropout": float(config.get("attention_dropout") or 0.0),
        **save_args(vocab, divisible_by, tp, iteration, sharding),
    }
