"""Hugging Face's ``LlamaForCausalLM`` <-> torchtitan's llama3 (fused ``wqkv``, complex RoPE): pure functions.

The two compute the same function; their tensors differ in three ways (torchtitan 0.3.0, transformers 5.23.0):

* **Names.** ``model.embed_tokens`` / ``tok_embeddings``, ``model.layers.{i}.self_attn.o_proj`` /
  ``layers.{i}.attention.wo``, ``mlp.gate_proj`` / ``feed_forward.w1``, ``mlp.up_proj`` / ``w3``, ``mlp.down_proj`` /
  ``w2``, ``input_layernorm`` / ``attention_norm``, ``post_attention_layernorm`` / ``ffn_norm``, ``model.norm`` /
  ``norm``, ``lm_head`` / ``lm_head`` (torchtitan ``models/llama3/state_dict_adapter.py``, ``from_hf_map``).
* **RoPE.** transformers rotates the two halves of a head (``rotate_half``: element ``j`` pairs with ``j + d/2``);
  torchtitan's ``ComplexRoPE`` views a head as ``d/2`` complex numbers of consecutive elements (``2j``, ``2j+1``;
  ``models/common/rope.py``, ``ComplexRoPE.apply_rotary_emb``). So within each query and key head, torchtitan's row
  ``2j`` is HF's row ``j`` and its row ``2j + 1`` is HF's row ``j + d/2``. Values are not touched by RoPE and keep
  their order.
* **Fused QKV.** torchtitan's llama3 holds one parameter ``layers.{i}.attention.qkv_linear.wqkv.weight``, per
  key/value group ``g``: the group's ``n`` query heads, then its key head, then its value head, ``d`` rows each
  (``models/common/attention.py``, ``FusedQKVLinear``: its output viewed as ``[G, n + 2, d]``, its state-dict hook
  splitting ``wq``, ``wk``, ``wv`` the same way). Query head ``j`` belongs to group ``j // n`` in both frameworks.

Every element goes to exactly one place and comes back, with no arithmetic, so the same map carries the weights and
Adam's moments (the optimizer is keyed by torchtitan's parameters: ``wqkv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: HF name within ``model.layers.{i}.`` -> torchtitan's within ``layers.{i}.``, for the tensors taken whole.
_PER_LAYER = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight"}
WQKV = "attention.qkv_linear.wqkv.weight"


@dataclass(frozen=True)
class Heads:
    """What the map needs of the model: its layers and its attention heads."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"{self.heads} query heads in {self.kv_heads} key/value heads of dimension "
                             f"{self.head_dim}: torchtitan's llama3 needs whole groups and an even head dimension")


def interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of each of ``heads`` heads -> torchtitan's complex (interleaved) order."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved`."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_titan(heads: Heads, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict -> torchtitan llama3's parameters (the module docstring); each output owns
    its storage."""
    out = {titan: hf[name].clone() for name, titan in _TOP.items()}
    n, g, d = heads.heads // heads.kv_heads, heads.kv_heads, heads.head_dim
    for i in range(heads.layers):
        p = f"model.layers.{i}."
        q = interleaved(hf[f"{p}self_attn.q_proj.weight"], heads.heads)
        k = interleaved(hf[f"{p}self_attn.k_proj.weight"], g)
        v = hf[f"{p}self_attn.v_proj.weight"]
        cols = q.shape[1]
        fused = torch.cat([q.reshape(g, n, d, cols), k.reshape(g, 1, d, cols), v.reshape(g, 1, d, cols)], dim=1)
        out[f"layers.{i}.{WQKV}"] = fused.reshape(g * (n + 2) * d, cols)
        out.update({f"layers.{i}.{titan}": hf[p + name].clone() for name, titan in _PER_LAYER.items()})
    return out


def from_titan(heads: Heads, titan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_titan`: ``from_titan(h, to_titan(h, x)) == x`` bit for bit."""
    out = {name: titan[t].clone() for name, t in _TOP.items()}
    n, g, d = heads.heads // heads.kv_heads, heads.kv_heads, heads.head_dim
    for i in range(heads.layers):
        p = f"model.layers.{i}."
        fused = titan[f"layers.{i}.{WQKV}"]
        cols = fused.shape[1]
        groups = fused.reshape(g, n + 2, d, cols)
        out[f"{p}self_attn.q_proj.weight"] = halves(groups[:, :n].reshape(g * n * d, cols), heads.heads).clone()
        out[f"{p}self_attn.k_proj.weight"] = halves(groups[:, n].reshape(g * d, cols), g).clone()
        out[f"{p}self_attn.v_proj.weight"] = groups[:, n + 1].reshape(g * d, cols).clone()
        out.update({p + name: titan[f"layers.{i}.{t}"].clone() for name, t in _PER_LAYER.items()})
    return out


def titan_names_of(hf_name: str) -> list[str]:
    """The torchtitan parameter a ``LlamaForCausalLM`` name's elements go to (one; a list to read as
    :func:`osdpipe.layout.megatron_hf.hf_names_of` does)."""
    if hf_name in _TOP:
        return [_TOP[hf_name]]
    _, _, i, within = hf_name.split(".", 3)
    if within in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        return [f"layers.{i}.{WQKV}"]
    return [f"layers.{i}.{_PER_LAYER[within]}"]


def hf_config(args: dict) -> dict:
    """The ``config.json`` of the ``LlamaForCausalLM`` that torchtitan's llama3 of ``args`` (the keywords of
    ``osdpipe.layout.models.torchtitan_llama3``, a ``model_args.json``) computes the function of: what a torchtitan
    checkpoint converts through (:mod:`osdpipe.layout.megatron_hf` takes it on to Megatron). Llama 3.1's RoPE
    scaling (``rope_scaling``, torchtitan's ``llama``) is transformers' ``llama3`` rope type, the same formula
    (transformers ``modeling_rope_utils.py`` ``_compute_llama3_parameters``, torchtitan ``ComplexRoPE``)."""
    dim, heads = int(args["dim"]), int(args["n_heads"])
    theta = float(args.get("rope_theta", 10000.0))
    scaling = args.get("rope_scaling")
    rope = {"rope_type": "default", "rope_theta": theta} if not scaling else {
        "rope_type": "llama3", "rope_theta": theta, "factor": float(scaling["scaling_factor"]),
        "low_freq_factor": float(scaling["low_freq_factor"]), "high_freq_factor": float(scaling["high_freq_factor"]),
        "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
    }
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
        "intermediate_size": int(args["hidden_dim"]), "num_attention_heads": heads,
        "num_key_value_heads": int(args.get("n_kv_heads") or heads), "head_dim": dim // heads,
        "num_hidden_layers": int(args["n_layers"]), "vocab_size": int(args["vocab_size"]), "hidden_act": "silu",
        "rms_norm_eps": float(args.get("norm_eps", 1e-5)), "rope_theta": theta,
        "rope_parameters": rope,
        "max_position_embeddings": int(args.get("max_seq_len", 4096)), "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
    }


def heads_of(args: dict) -> Heads:
    """The :class:`Heads` of torchtitan's llama3 of ``args`` (``model_args.json``'s keywords)."""
    heads = int(args["n_heads"])
    return Heads(int(args["n_layers"]), heads, int(args.get("n_kv_heads") or heads), int(args["dim"]) // heads)
