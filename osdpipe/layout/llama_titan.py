"""Hugging Face's Llama family <-> torchtitan's decoders of it (fused ``wqkv``): pure functions, and the registry of
the torchtitan models a Megatron GPT or a Hugging Face model of the family becomes (:data:`FAMILIES`).

Two of torchtitan 0.3.0's models compute what transformers 5.23.0's Llama family computes: its **llama3** (complex
RoPE) is ``LlamaForCausalLM``, its **qwen3** (rotate-half RoPE, a norm of each head's query and key) is
``Qwen3ForCausalLM``. Their tensors differ from transformers' in up to four ways:

* **Names.** ``model.embed_tokens`` / ``tok_embeddings``, ``model.layers.{i}.self_attn.o_proj`` /
  ``layers.{i}.attention.wo``, ``mlp.gate_proj`` / ``feed_forward.w1``, ``mlp.up_proj`` / ``w3``, ``mlp.down_proj`` /
  ``w2``, ``input_layernorm`` / ``attention_norm``, ``post_attention_layernorm`` / ``ffn_norm``, ``model.norm`` /
  ``norm``, ``lm_head`` / ``lm_head``; qwen3's ``self_attn.q_norm`` / ``attention.q_norm`` and ``k_norm`` likewise
  (torchtitan ``models/llama3/state_dict_adapter.py`` and ``models/qwen3/state_dict_adapter.py``, ``from_hf_map``).
* **RoPE (llama3 only).** transformers rotates the two halves of a head (``rotate_half``: element ``j`` pairs with
  ``j + d/2``); torchtitan's ``ComplexRoPE`` views a head as ``d/2`` complex numbers of consecutive elements (``2j``,
  ``2j+1``; ``models/common/rope.py``, ``ComplexRoPE.apply_rotary_emb``). So within each query and key head,
  torchtitan's row ``2j`` is HF's row ``j`` and its row ``2j + 1`` is HF's row ``j + d/2``. Values are not touched by
  RoPE and keep their order. qwen3's ``CosSinRoPE`` rotates halves, as transformers does: its rows keep HF's order.
* **Fused QKV.** Both hold one parameter ``layers.{i}.attention.qkv_linear.wqkv.weight``, per key/value group ``g``:
  the group's ``n`` query heads, then its key head, then its value head, ``d`` rows each (``models/common/
  attention.py``, ``FusedQKVLinear``: its output viewed as ``[G, n + 2, d]``, its state-dict hook splitting ``wq``,
  ``wk``, ``wv`` the same way). Query head ``j`` belongs to group ``j // n`` in both frameworks.
* **Head dimension.** llama3 takes it as ``dim / n_heads``; qwen3 has its own (``head_dim``, as Qwen3 does).

Either can tie its output layer to the embedding (torchtitan's ``enable_weight_tying``: llama3's 1B and 3B, qwen3's
0.6B to 4B; the factories' ``tie_embeddings``): one parameter, ``tok_embeddings.weight``, as transformers' tied model
holds one, ``model.embed_tokens.weight``; neither has an ``lm_head`` of its own to map (:attr:`Heads.tied`).

Every element goes to exactly one place and comes back, with no arithmetic, so the same map carries the weights and
Adam's moments (the optimizer is keyed by torchtitan's parameters: ``wqkv``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from osdpipe.layout.maps import Map, rows
from osdpipe.layout.ranges import Segment

#: HF name within ``model.layers.{i}.`` -> torchtitan's within ``layers.{i}.``, for the tensors taken whole.
_PER_LAYER = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
#: The same for a family with :attr:`TitanFamily.head_norms` (qwen3): each a norm of the head dimension, taken whole.
_HEAD_NORMS = {"self_attn.q_norm.weight": "attention.q_norm.weight",
               "self_attn.k_norm.weight": "attention.k_norm.weight"}
_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight"}
WQKV = "attention.qkv_linear.wqkv.weight"


@dataclass(frozen=True)
class TitanFamily:
    """One torchtitan model a Llama-family model becomes: what its map and its ``model_args.json`` differ in.

    Attributes:
        name: torchtitan's name of the model (``torchtitan.models.<name>``, ``--model.name``).
        factory: the ``model.factory`` that builds it of any dimensions (:mod:`osdpipe.layout.models`), from the
            keywords osdpipe writes to ``model_args.json``.
        complex_rope: its RoPE pairs consecutive elements (``ComplexRoPE``): query and key rows are interleaved.
        head_norms: it norms each head's query and key (``q_norm``, ``k_norm``).
        own_head_dim: ``head_dim`` is one of its keywords (else it is ``dim / n_heads``); what tells its
            ``model_args.json`` from the others' (:func:`family_of`).
        rope_scalings: the RoPE scalings of torchtitan's config its factory takes (``"llama"``: Llama 3.1's, as
            ``rope_scaling``).
    """

    name: str
    factory: str
    complex_rope: bool
    head_norms: bool
    own_head_dim: bool
    rope_scalings: tuple[str, ...] = ("none",)

    def per_layer(self) -> dict[str, str]:
        """HF name -> torchtitan's, within a layer, of the tensors taken whole."""
        return {**_PER_LAYER, **(_HEAD_NORMS if self.head_norms else {})}


LLAMA3 = TitanFamily("llama3", "torchtitan_llama3", complex_rope=True, head_norms=False, own_head_dim=False,
                     rope_scalings=("none", "llama"))
QWEN3 = TitanFamily("qwen3", "torchtitan_qwen3", complex_rope=False, head_norms=True, own_head_dim=True)
#: The torchtitan models osdpipe writes and reads a Llama-family model as, by factory.
FAMILIES = {f.factory: f for f in (LLAMA3, QWEN3)}


def family_of(args: dict) -> TitanFamily:
    """The family whose factory's keywords ``args`` (a ``model_args.json``) are: qwen3's name a ``head_dim``."""
    return QWEN3 if "head_dim" in args else LLAMA3


@dataclass(frozen=True)
class Heads:
    """What the map needs of the model: its family, its layers, its attention heads, and whether its output layer is
    the embedding (``tied``: neither side has an ``lm_head`` parameter of its own)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    family: TitanFamily = LLAMA3
    tied: bool = False

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"{self.heads} query heads in {self.kv_heads} key/value heads of dimension "
                             f"{self.head_dim}: torchtitan's {self.family.name} needs whole groups and an even head "
                             "dimension")

    def rope_rows(self, w: torch.Tensor, heads: int) -> torch.Tensor:
        """HF's rows of ``heads`` query or key heads in torchtitan's order (:func:`interleaved` for complex RoPE)."""
        return interleaved(w, heads) if self.family.complex_rope else w

    def hf_rows(self, w: torch.Tensor, heads: int) -> torch.Tensor:
        """The inverse of :meth:`rope_rows`."""
        return halves(w, heads) if self.family.complex_rope else w

    def top(self) -> dict[str, str]:
        """HF name -> torchtitan's of the tensors outside the layers: the embedding, the final norm and, untied, the
        output layer."""
        return {hf: titan for hf, titan in _TOP.items() if not (self.tied and hf == "lm_head.weight")}


def interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of each of ``heads`` heads -> torchtitan's complex (interleaved) order."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved`."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_titan(heads: Heads, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict of the family (``LlamaForCausalLM``, ``Qwen3ForCausalLM``) -> the torchtitan model's
    parameters (the module docstring); each output owns its storage."""
    out = {titan: hf[name].clone() for name, titan in heads.top().items()}
    n, g, d = heads.heads // heads.kv_heads, heads.kv_heads, heads.head_dim
    for i in range(heads.layers):
        p = f"model.layers.{i}."
        q = heads.rope_rows(hf[f"{p}self_attn.q_proj.weight"], heads.heads)
        k = heads.rope_rows(hf[f"{p}self_attn.k_proj.weight"], g)
        v = hf[f"{p}self_attn.v_proj.weight"]
        cols = q.shape[1]
        fused = torch.cat([q.reshape(g, n, d, cols), k.reshape(g, 1, d, cols), v.reshape(g, 1, d, cols)], dim=1)
        out[f"layers.{i}.{WQKV}"] = fused.reshape(g * (n + 2) * d, cols)
        out.update({f"layers.{i}.{titan}": hf[p + name].clone() for name, titan in heads.family.per_layer().items()})
    return out


def from_titan(heads: Heads, titan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_titan`: ``from_titan(h, to_titan(h, x)) == x`` bit for bit."""
    out = {name: titan[t].clone() for name, t in heads.top().items()}
    n, g, d = heads.heads // heads.kv_heads, heads.kv_heads, heads.head_dim
    for i in range(heads.layers):
        p = f"model.layers.{i}."
        fused = titan[f"layers.{i}.{WQKV}"]
        cols = fused.shape[1]
        groups = fused.reshape(g, n + 2, d, cols)
        out[f"{p}self_attn.q_proj.weight"] = heads.hf_rows(groups[:, :n].reshape(g * n * d, cols), heads.heads).clone()
        out[f"{p}self_attn.k_proj.weight"] = heads.hf_rows(groups[:, n].reshape(g * d, cols), g).clone()
        out[f"{p}self_attn.v_proj.weight"] = groups[:, n + 1].reshape(g * d, cols).clone()
        out.update({p + name: titan[f"layers.{i}.{t}"].clone() for name, t in heads.family.per_layer().items()})
    return out


def titan_map(heads: Heads, hf_shapes: dict[str, tuple[int, ...]]) -> Map:
    """:func:`to_titan` as data (:mod:`osdpipe.layout.maps`): each torchtitan parameter as the ranges of the Hugging
    Face model's (of ``hf_shapes``) it is made of: ``wqkv`` per key/value group its query heads, key head and value
    head, each query and key head's rows in torchtitan's RoPE order (:meth:`Heads.rope_rows`), runs of rows merged."""
    out: Map = {titan: (Segment(name, 0, math.prod(hf_shapes[name]), 0),) for name, titan in heads.top().items()}
    n, g, d = heads.heads // heads.kv_heads, heads.kv_heads, heads.head_dim

    def head(name: str, first: int, at: int, cols: int, rope: bool) -> list[Segment]:
        """Head rows ``[first, first + d)`` of ``name`` at row ``at``, in torchtitan's order where ``rope``."""
        if not (rope and heads.family.complex_rope):
            return [rows(name, first, d, cols, at)]
        return [rows(name, first + (r % 2) * (d // 2) + r // 2, 1, cols, at + r) for r in range(d)]

    for i in range(heads.layers):
        p = f"model.layers.{i}."
        cols = hf_shapes[f"{p}self_attn.q_proj.weight"][1]
        fused: list[Segment] = []
        for j in range(g):
            at = j * (n + 2) * d
            for k in range(n):
                fused += head(f"{p}self_attn.q_proj.weight", (j * n + k) * d, at + k * d, cols, rope=True)
            fused += head(f"{p}self_attn.k_proj.weight", j * d, at + n * d, cols, rope=True)
            fused += head(f"{p}self_attn.v_proj.weight", j * d, at + (n + 1) * d, cols, rope=False)
        out[f"layers.{i}.{WQKV}"] = tuple(fused)
        out.update({f"layers.{i}.{titan}": (Segment(p + name, 0, math.prod(hf_shapes[p + name]), 0),)
                    for name, titan in heads.family.per_layer().items()})
    return out


def titan_names_of(hf_name: str) -> list[str]:
    """The torchtitan parameter a Hugging Face name's elements go to (one; a list to read as
    :func:`osdpipe.layout.megatron_hf.hf_names_of` does); the names are the same in every family that has them."""
    if hf_name in _TOP:
        return [_TOP[hf_name]]
    _, _, i, within = hf_name.split(".", 3)
    if within in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        return [f"layers.{i}.{WQKV}"]
    whole = {**_PER_LAYER, **_HEAD_NORMS}  # every family's tensors taken whole (a name is the same in each)
    return [f"layers.{i}.{whole[within]}"]


def hf_config(args: dict) -> dict:
    """The ``config.json`` of the Hugging Face model that the torchtitan model of ``args`` (its factory's keywords, a
    ``model_args.json``: :func:`family_of` says which) computes the function of: what a torchtitan checkpoint converts
    through (:mod:`osdpipe.layout.megatron_hf` takes it on to Megatron). llama3's is a ``LlamaForCausalLM``, its Llama
    3.1 RoPE scaling (``rope_scaling``, torchtitan's ``llama``) transformers' ``llama3`` rope type, the same formula
    (transformers ``modeling_rope_utils.py`` ``_compute_llama3_parameters``, torchtitan ``ComplexRoPE``); qwen3's a
    ``Qwen3ForCausalLM`` of its own head dimension, full attention in every layer."""
    family = family_of(args)
    dim, heads = int(args["dim"]), int(args["n_heads"])
    theta = float(args.get("rope_theta", 10000.0))
    scaling = args.get("rope_scaling")
    rope = {"rope_type": "default", "rope_theta": theta} if not scaling else {
        "rope_type": "llama3", "rope_theta": theta, "factor": float(scaling["scaling_factor"]),
        "low_freq_factor": float(scaling["low_freq_factor"]), "high_freq_factor": float(scaling["high_freq_factor"]),
        "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
    }
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
        "intermediate_size": int(args["hidden_dim"]), "num_attention_heads": heads,
        "num_key_value_heads": int(args.get("n_kv_heads") or heads), "head_dim": heads_of(args).head_dim,
        "num_hidden_layers": int(args["n_layers"]), "vocab_size": int(args["vocab_size"]), "hidden_act": "silu",
        "rms_norm_eps": float(args.get("norm_eps", 1e-5)), "rope_theta": theta,
        "rope_parameters": rope,
        "max_position_embeddings": int(args.get("max_seq_len", 4096)),
        "tie_word_embeddings": bool(args.get("tie_embeddings", False)),
        "attention_bias": False, "mlp_bias": False,
    }
    if family is QWEN3:  # no MLP bias option, no sliding window (Megatron's own Qwen3 config says the same)
        del config["mlp_bias"]
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", **full_attention(int(args["n_layers"])))
    return config


def full_attention(layers: int) -> dict[str, Any]:
    """The keys that say a Qwen model (2 or 3) attends fully in each of its ``layers``: transformers picks a layer's
    attention from ``use_sliding_window`` and ``max_window_layers``, and a Qwen config's own defaults may slide;
    torchtitan and Megatron-Core train full attention only, so every config osdpipe writes for a Qwen says so."""
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}


def heads_of(args: dict) -> Heads:
    """The :class:`Heads` of the torchtitan model of ``args`` (its factory's keywords, a ``model_args.json``)."""
    family, heads = family_of(args), int(args["n_heads"])
    head_dim = int(args["head_dim"]) if family.own_head_dim else int(args["dim"]) // heads
    return Heads(int(args["n_layers"]), heads, int(args.get("n_kv_heads") or heads), head_dim, family,
                 bool(args.get("tie_embeddings", False)))
