"""Megatron-LM's default GPT <-> Hugging Face's ``GPT2LMHeadModel``: the config and the weights' map, pure functions.

What Megatron-LM's ``pretrain_gpt.py`` builds where its arguments are silent (LayerNorm, a learned position table,
GeLU, a bias on every linear, multi-head attention, the output layer tied to the word embedding) computes the function
of transformers' GPT-2; only the tensors are named, cut and laid out differently. The map (Megatron's sharded keys as
:func:`osdpipe.layout.megatron.global_shapes` gives them, the decoder's layers stacked on axis 0; ``H`` heads of ``d``,
``f`` the FFN size, ``V`` the true vocabulary and ``Vp`` Megatron's padded one; GPT-2's names under ``transformer.``):

=================================================  =============================================================
Megatron                                           GPT-2 (layer ``i``)
=================================================  =============================================================
``embedding.word_embeddings.weight`` ``[Vp, h]``   ``wte.weight``: rows ``[0, V)``
``embedding.position_embeddings.weight``           ``wpe.weight``
``...linear_qkv.layer_norm_weight/bias[i]``        ``h.{i}.ln_1.weight/bias``
``...linear_qkv.weight[i]`` ``[3 H d, h]``         ``h.{i}.attn.c_attn.weight`` ``[h, 3 H d]``, transposed: head
                                                   ``j``'s rows ``[3 j d, 3 j d + d)`` are q's columns
                                                   ``[j d, (j+1) d)``, the next ``d`` k's ``[H d + j d, ..)``, the
                                                   next ``d`` v's ``[2 H d + j d, ..)``
``...linear_qkv.bias[i]``                          ``h.{i}.attn.c_attn.bias``: as the weight's rows
``...linear_proj.weight/bias[i]``                  ``h.{i}.attn.c_proj.weight`` (transposed) ``/bias``
``...linear_fc1.layer_norm_weight/bias[i]``        ``h.{i}.ln_2.weight/bias``
``...linear_fc1.weight/bias[i]``                   ``h.{i}.mlp.c_fc.weight`` (transposed) ``/bias``
``...linear_fc2.weight/bias[i]``                   ``h.{i}.mlp.c_proj.weight`` (transposed) ``/bias``
``decoder.final_layernorm.weight/bias``            ``ln_f.weight/bias``
``output_layer.weight`` (untied)                   ``lm_head.weight``: rows ``[0, V)`` (tied: none, as
                                                   ``save_pretrained`` writes a tied GPT-2)
=================================================  =============================================================

Every element goes to exactly one place and comes back, with no arithmetic (a transpose is a copy): the same map
carries the fp32 masters. The other way, a GPT-2's folder becomes such a GPT (:func:`megatron_args`, :func:`from_hf`):
what continues pretraining from ``gpt2`` in Megatron-LM. A family of :mod:`osdpipe.layout.megatron_hf`'s registry
(:class:`osdpipe.layout.megatron_hf.HfFamily`): a GPT with LayerNorm and a learned position table, and a ``gpt2``
config.json, are this family's, in a model folder and in a PyTorch job's training checkpoint (the HF Trainer's,
accelerate's: a ``GPT2LMHeadModel``'s optimizer state, by its ``named_parameters()``, :func:`hf_shapes`).

Why each rule, in the sources installed here (megatron-core 0.16.1, transformers 5.23.0):

* **qkv.** megatron ``transformer/attention.py`` ``get_query_key_value_tensors`` views ``linear_qkv``'s output per
  query group as ``[n d query, d key, d value]``; without ``group_query_attention`` every head is its own group
  (``n = 1``). transformers ``models/gpt2/modeling_gpt2.py`` ``GPT2Attention.forward`` splits ``c_attn``'s output in
  three (``split(self.split_size, dim=2)``: all queries, all keys, all values), each viewed as consecutive heads of
  ``d``.
* **Conv1D.** transformers ``pytorch_utils.Conv1D`` computes ``x @ weight + bias`` with ``weight`` ``[in, out]``:
  the transpose of a ``torch.nn.Linear``'s, which Megatron's layers are.
* **GeLU.** megatron-core ``transformer/mlp.py`` (l. 171-202): with ``bias_activation_fusion`` (Megatron-LM's
  ``--bias-gelu-fusion``, on by default) and a bias, ``bias_gelu_impl`` (``fusions/fused_bias_gelu.py``: the tanh
  approximation, transformers' ``gelu_new``); ``--openai-gelu`` is the same approximation; otherwise ``F.gelu``, the
  exact one (transformers' ``gelu``). :func:`activation` picks the one the save's job computed.
* **Norms, positions, scale.** LayerNorm with ``norm_epsilon`` both sides (``torch.nn.LayerNorm``; GPT-2's
  ``layer_norm_epsilon``); the position table added to the word embedding by position index (megatron
  ``models/common/embeddings/language_model_embedding.py``; GPT-2's ``wpe``); attention scaled by ``1/sqrt(d)``
  (GPT-2's ``scale_attn_weights``, neither by the layer index nor reordered).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from osdpipe.layout.maps import Map, Transposed, rows
from osdpipe.layout.megatron import (
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

GPT2 = "GPT2LMHeadModel"
#: The ``model.factory`` of transformers' GPT-2 of a ``config.json``'s keys.
HF_FACTORY = "hf_gpt2"
HF_EMBEDDING = "transformer.wte.weight"
EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
QKV = f"{LAYERS}self_attention.linear_qkv."
OUTPUT = "output_layer.weight"

#: Megatron key of a per-layer tensor -> its GPT-2 name in ``h.{i}.``, and whether it is transposed (a Conv1D's weight).
_PER_LAYER = {
    f"{LAYERS}self_attention.linear_qkv.layer_norm_weight": ("ln_1.weight", False),
    f"{LAYERS}self_attention.linear_qkv.layer_norm_bias": ("ln_1.bias", False),
    f"{LAYERS}self_attention.linear_proj.weight": ("attn.c_proj.weight", True),
    f"{LAYERS}self_attention.linear_proj.bias": ("attn.c_proj.bias", False),
    f"{LAYERS}mlp.linear_fc1.layer_norm_weight": ("ln_2.weight", False),
    f"{LAYERS}mlp.linear_fc1.layer_norm_bias": ("ln_2.bias", False),
    f"{LAYERS}mlp.linear_fc1.weight": ("mlp.c_fc.weight", True),
    f"{LAYERS}mlp.linear_fc1.bias": ("mlp.c_fc.bias", False),
    f"{LAYERS}mlp.linear_fc2.weight": ("mlp.c_proj.weight", True),
    f"{LAYERS}mlp.linear_fc2.bias": ("mlp.c_proj.bias", False),
}
#: The keys outside the layers -> GPT-2's names.
_FIXED = {EMBEDDING: "transformer.wte.weight", POSITIONS: "transformer.wpe.weight",
          "decoder.final_layernorm.weight": "transformer.ln_f.weight",
          "decoder.final_layernorm.bias": "transformer.ln_f.bias", OUTPUT: "lm_head.weight"}
_VOCAB_ROWS = (EMBEDDING, OUTPUT)


def fits_args(args: dict[str, Any]) -> bool:
    """Whether the GPT Megatron-LM's ``args`` describe is written as a GPT-2 (LayerNorm and a learned position table,
    Megatron-LM's defaults where ``args`` are silent), not as a Llama (:mod:`osdpipe.layout.megatron_llama`)."""
    return args.get("normalization", "LayerNorm") == "LayerNorm" and position_embedding_type(args) == "learned_absolute"


def fits_gpt(gpt: Gpt) -> bool:
    """Whether a GPT layout is mapped as a GPT-2's: its norms have biases (LayerNorm); :func:`to_hf` and
    :func:`from_hf` refuse the rest of what GPT-2 has not."""
    return gpt.norm_bias


def architecture(args: dict[str, Any]) -> str:
    """transformers' model of this family: one architecture, whatever the ``args``."""
    return GPT2


def activation(args: dict[str, Any]) -> str:
    """transformers' name of the GeLU the job of ``args`` computed (module docstring): ``gelu_new`` (tanh) with
    ``--openai-gelu`` or the fused bias GeLU (``bias_gelu_fusion``, Megatron-LM's default, absent args included, with
    linear biases), else ``gelu`` (exact)."""
    fused = args.get("bias_gelu_fusion", True) and args.get("add_bias_linear", True)
    return "gelu_new" if args.get("openai_gelu") or fused else "gelu"


def refusals(args: dict[str, Any]) -> list[str]:
    """What of the GPT ``args`` describe transformers' GPT-2 cannot express (empty: nothing). Absent args take
    Megatron-LM's defaults (all of which GPT-2 has)."""
    heads, hidden = int(args.get("num_attention_heads") or 1), int(args.get("hidden_size") or 0)
    checks = [
        (query_groups(args) != heads, "grouped-query attention (GPT-2's heads each have a key and a value)"),
        (bool(args.get("swiglu")), "SwiGLU"),
        (not args.get("add_bias_linear", True), "linears without biases (GPT-2 biases every linear)"),
        (int(args.get("kv_channels") or hidden // heads) * heads != hidden,
         "a head dimension other than hidden / heads"),
        (bool(args.get("qk_layernorm")), "qk_layernorm (GPT-2 norms no query or key)"),
    ]
    return [what for bad, what in checks if bad] + block_refusals(args)


def _refuse(what: list[str]) -> None:
    if what:
        raise ValueError(f"a Megatron GPT with {', '.join(what)}: not supported yet as a Hugging Face GPT-2")


def hf_config(args: dict[str, Any], *, vocab_size: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of the ``GPT2LMHeadModel`` that computes the GPT Megatron-LM's ``args`` describe, for
    ``vocab_size`` tokens with weights of ``dtype``; dropout as the job's.

    Raises:
        ValueError: one line naming what GPT-2 cannot express (:func:`refusals`), "not supported yet".
    """
    _refuse(refusals(args))
    hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    return {
        "architectures": [GPT2],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": int(args["max_position_embeddings"]),
        "n_embd": hidden,
        "n_layer": int(args["num_layers"]),
        "n_head": heads,
        "n_inner": int(args["ffn_hidden_size"]),
        "activation_function": activation(args),
        "layer_norm_epsilon": float(args.get("norm_epsilon", 1e-5)),
        "resid_pdrop": float(args.get("hidden_dropout", 0.1)),
        "embd_pdrop": float(args.get("hidden_dropout", 0.1)),
        "attn_pdrop": float(args.get("attention_dropout", 0.1)),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": tied_embeddings(args),
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _check_gpt(gpt: Gpt) -> None:
    checks = [
        (gpt.num_query_groups != gpt.num_attention_heads, "grouped-query attention"),
        (gpt.swiglu, "SwiGLU"),
        (not gpt.norm_bias, "RMSNorm"),
        (not gpt.position_table, "RoPE"),
        (not gpt.linear_bias, "linears without biases"),
        (gpt.kv_channels * gpt.num_attention_heads != gpt.hidden_size, "a head dimension other than hidden / heads"),
        (gpt.qk_layernorm, "qk_layernorm"),
    ]
    _refuse([what for bad, what in checks if bad])


def hf_shapes(gpt: Gpt, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the ``GPT2LMHeadModel`` state dict :func:`to_hf` gives, and its shape, in transformers'
    ``named_parameters()`` order."""
    h, f, qkv = gpt.hidden_size, gpt.ffn_hidden_size, 3 * gpt.num_attention_heads * gpt.kv_channels
    out: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (vocab_size, h),
                                       "transformer.wpe.weight": (gpt.position_table, h)}
    for i in range(gpt.num_layers):
        p = f"transformer.h.{i}."
        out.update({p + "ln_1.weight": (h,), p + "ln_1.bias": (h,), p + "attn.c_attn.weight": (h, qkv),
                    p + "attn.c_attn.bias": (qkv,), p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
                    p + "ln_2.weight": (h,), p + "ln_2.bias": (h,), p + "mlp.c_fc.weight": (h, f),
                    p + "mlp.c_fc.bias": (f,), p + "mlp.c_proj.weight": (f, h), p + "mlp.c_proj.bias": (h,)})
    out.update({"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)})
    if not gpt.tied:
        out["lm_head.weight"] = (vocab_size, h)
    return out


def hf_names_of(gpt: Gpt) -> dict[str, list[str]]:
    """Each Megatron key of :func:`osdpipe.layout.megatron.global_shapes` -> the ``GPT2LMHeadModel`` names its elements
    go to under :func:`to_hf`, in the state dict's order (a layer's key: one name per layer)."""
    megatron_of = {name: key for key, name in _FIXED.items()}
    per_layer = {name: key for key, (name, _) in _PER_LAYER.items()}
    per_layer.update({"attn.c_attn.weight": QKV + "weight", "attn.c_attn.bias": QKV + "bias"})
    by_key: dict[str, list[str]] = {key: [] for key in global_shapes(gpt)}
    for name in hf_shapes(gpt, 1):
        key = megatron_of.get(name) or per_layer[name.split(".", 3)[3]]  # transformer.h.{i}.<within>
        by_key[key].append(name)
    return by_key


def _qkv_order(gpt: Gpt) -> torch.Tensor:
    """Megatron's ``linear_qkv`` row of each ``c_attn`` output column: q of every head, then k, then v."""
    heads, d = gpt.num_attention_heads, gpt.kv_channels
    rows = torch.arange(3 * heads * d).reshape(heads, 3, d)  # per head: its q, k, v rows
    return rows.permute(1, 0, 2).reshape(-1)


def to_hf(gpt: Gpt, tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Megatron's GPT tensors (every key of :func:`osdpipe.layout.megatron.global_shapes`) -> the ``GPT2LMHeadModel``
    state dict (module docstring's table), the vocabulary cut to its first ``vocab_size`` rows; each output owns its
    storage and is contiguous, as ``safetensors`` wants."""
    _check_gpt(gpt)
    if not 0 < vocab_size <= gpt.padded_vocab_size:
        raise ValueError(f"vocabulary {vocab_size} is not in (0, padded vocabulary {gpt.padded_vocab_size}]")
    check_shapes(tensors, global_shapes(gpt), "Megatron GPT tensors")
    order = _qkv_order(gpt)
    out = {name: tensors[key][:vocab_size].clone() if key in _VOCAB_ROWS else tensors[key].clone()
           for key, name in _FIXED.items() if key in tensors}
    for i in range(gpt.num_layers):
        p = f"transformer.h.{i}."
        out[p + "attn.c_attn.weight"] = tensors[QKV + "weight"][i][order].t().contiguous()
        out[p + "attn.c_attn.bias"] = tensors[QKV + "bias"][i][order].clone()
        for key, (name, transposed) in _PER_LAYER.items():
            out[p + name] = tensors[key][i].t().contiguous() if transposed else tensors[key][i].clone()
    return {name: out[name] for name in hf_shapes(gpt, vocab_size)}


def hf_map(gpt: Gpt, vocab_size: int) -> Map:
    """:func:`to_hf` as data (:mod:`osdpipe.layout.maps`): each ``GPT2LMHeadModel`` parameter as the pieces of
    Megatron's GPT tensors (layers stacked) it is made of: a Conv1D's weight a layer's block of its linear, transposed
    (``c_attn``'s rows first put in :func:`_qkv_order`), ``c_attn``'s bias a run per head of each of q, k and v, the
    vocabulary's first ``vocab_size`` rows; :func:`osdpipe.layout.maps.invert` gives :func:`from_hf`'s."""
    _check_gpt(gpt)
    if not 0 < vocab_size <= gpt.padded_vocab_size:
        raise ValueError(f"vocabulary {vocab_size} is not in (0, padded vocabulary {gpt.padded_vocab_size}]")
    shapes, h = global_shapes(gpt), gpt.hidden_size
    heads, d = gpt.num_attention_heads, gpt.kv_channels
    out: Map = {name: (rows(key, 0, vocab_size, h, 0),) if key in _VOCAB_ROWS
                else (Segment(key, 0, math.prod(shapes[key]), 0),) for key, name in _FIXED.items() if key in shapes}
    qkv, order = 3 * heads * d, tuple(_qkv_order(gpt).tolist())
    for i in range(gpt.num_layers):
        p = f"transformer.h.{i}."
        out[p + "attn.c_attn.weight"] = (Transposed(QKV + "weight", i * qkv * h, qkv, h, 0, before=order),)
        out[p + "attn.c_attn.bias"] = tuple(Segment(QKV + "bias", i * qkv + (j * 3 + t) * d, d, (t * heads + j) * d)
                                            for t in range(3) for j in range(heads))
        for key, (name, transposed) in _PER_LAYER.items():
            layer = shapes[key][1:]
            at = i * math.prod(layer)
            out[p + name] = ((Transposed(key, at, layer[0], layer[1], 0),) if transposed
                             else (Segment(key, at, math.prod(layer), 0),))
    return {name: out[name] for name in hf_shapes(gpt, vocab_size)}


def from_hf(gpt: Gpt, tensors: dict[str, torch.Tensor], padded_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_hf`: a ``GPT2LMHeadModel`` state dict -> Megatron's GPT tensors (layers stacked), the
    embedding (and an untied output layer) padded with zero rows to ``padded_vocab`` (default ``gpt``'s)."""
    _check_gpt(gpt)
    padded = gpt.padded_vocab_size if padded_vocab is None else int(padded_vocab)
    vocab = int(tensors["transformer.wte.weight"].shape[0]) if "transformer.wte.weight" in tensors else 0
    if not 0 < vocab <= padded:
        raise ValueError(f"Hugging Face GPT-2 tensors: vocabulary {vocab} does not fit the padded vocabulary {padded}")
    check_shapes(tensors, hf_shapes(gpt, vocab), "Hugging Face GPT-2 tensors")
    back = torch.argsort(_qkv_order(gpt))
    out: dict[str, torch.Tensor] = {}
    for key, name in _FIXED.items():
        if name in tensors:
            t = tensors[name]
            out[key] = torch.cat([t, t.new_zeros((padded - vocab, *t.shape[1:]))]) if key in _VOCAB_ROWS else t.clone()
    layers = [f"transformer.h.{i}." for i in range(gpt.num_layers)]
    out[QKV + "weight"] = torch.stack([tensors[p + "attn.c_attn.weight"].t()[back] for p in layers])
    out[QKV + "bias"] = torch.stack([tensors[p + "attn.c_attn.bias"][back] for p in layers])
    for key, (name, transposed) in _PER_LAYER.items():
        out[key] = torch.stack([tensors[p + name].t() if transposed else tensors[p + name] for p in layers])
    return {key: out[key].contiguous() for key in global_shapes(gpt)}



# ----------------------------------------------------------------------------------------------------------------------
# Hugging Face GPT-2 -> Megatron GPT: the config.


def fits_config(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face ``config.json`` is a GPT-2's (``model_type`` gpt2)."""
    return config.get("model_type") == "gpt2"


#: transformers' GeLUs (``activation_function``) -> Megatron-LM's ``openai_gelu``: the tanh approximation, or the exact.
_GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}


def hf_refusals(config: dict[str, Any]) -> list[str]:
    """What of a GPT-2's ``config.json`` Megatron's GPT (the local layer spec) cannot express (empty: nothing)."""
    act = config.get("activation_function", "gelu_new")
    checks = [
        (config.get("architectures", [GPT2]) != [GPT2], f"architectures {config.get('architectures')}, not {GPT2}"),
        (act not in _GELUS, f"the {act} activation (not a GeLU)"),
        (config.get("scale_attn_weights", True) is not True, "unscaled attention (scale_attn_weights false)"),
        (bool(config.get("scale_attn_by_inverse_layer_idx")), "attention scaled by the layer (scale_attn_by_inverse_"
                                                             "layer_idx)"),
        (bool(config.get("add_cross_attention")), "cross-attention"),
    ]
    return [what for bad, what in checks if bad]


def megatron_args(config: dict[str, Any], tp: int, pp: int, world: int, *, iteration: int, sharding: str,
                  divisible_by: int, vpp: int = 1) -> dict[str, Any]:
    """The Megatron-LM ``args`` of the GPT that computes the ``GPT2LMHeadModel`` of ``config``: the inverse of
    :func:`hf_config` (LayerNorm, a learned position table, the GeLU it names, every linear biased, multi-head
    attention, tied or untied embeddings), for TP ``tp`` x PP ``pp`` on ``world`` ranks (``vpp`` model chunks per
    stage).

    Raises:
        ValueError: one line: what Megatron cannot express (:func:`hf_refusals`), "not supported yet"; or a TP that
            does not divide the heads or the FFN, a PP that does not divide the layers, a world that is no multiple of
            TP x PP.
    """
    what = hf_refusals(config)
    if what:
        raise ValueError(f"a Hugging Face GPT-2 with {', '.join(what)}: not supported yet as a Megatron GPT")
    try:
        hidden, heads, layers = int(config["n_embd"]), int(config["n_head"]), int(config["n_layer"])
        vocab, positions = int(config["vocab_size"]), int(config["n_positions"])
    except KeyError as exc:
        raise ValueError(f"config.json holds no {exc.args[0]}, which a GPT-2's config has") from None
    ffn = int(config.get("n_inner") or 4 * hidden)
    grid = grid_args(((heads, "attention heads"), (ffn, "n_inner (the FFN)")), layers, tp, pp, world, vpp)
    return {
        **grid,
        # the model
        "num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
        "group_query_attention": False, "num_query_groups": heads, "kv_channels": hidden // heads,
        "seq_length": positions, "max_position_embeddings": positions, "normalization": "LayerNorm",
        "norm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)), "apply_layernorm_1p": False, "swiglu": False,
        "squared_relu": False, "openai_gelu": _GELUS[config.get("activation_function", "gelu_new")],
        "bias_gelu_fusion": False, "position_embedding_type": "learned_absolute",
        "use_rotary_position_embeddings": False, "add_position_embedding": True,
        # RoPE's, unused, at Megatron-LM's defaults: its args hold every argument, and readers of a save ask for them
        "rotary_base": 10000, "rotary_percent": 1.0, "rotary_interleaved": False, "use_rope_scaling": False,
        "rope_scaling_factor": 8.0,
        "untie_embeddings_and_output_weights": not tied_word_embeddings(config),
        "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False, "num_experts": None,
        "transformer_impl": "local", "hidden_dropout": float(config.get("resid_pdrop", 0.1)),
        "attention_dropout": float(config.get("attn_pdrop", 0.1)),
        **save_args(vocab, divisible_by, tp, iteration, sharding),
    }  # fmt: skip
