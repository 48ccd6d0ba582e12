"""Hugging Face's Llama <-> torchtitan's llama3 (:mod:`osdpipe.layout.llama_titan`): a permutation of the elements,
bitwise both ways, and the same tensors torchtitan's own HF adapter and its fused-QKV load hook make."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from osdpipe.layout.llama_titan import WQKV, Heads, from_titan, halves, interleaved, to_titan

HEADS = Heads(layers=2, heads=4, kv_heads=2, head_dim=6)
DIM, FFN, VOCAB = 24, 10, 13


def _hf(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A Llama state dict whose every element is distinct (its position in one long arange)."""
    shapes = {"model.embed_tokens.weight": (VOCAB, DIM), "model.norm.weight": (DIM,), "lm_head.weight": (VOCAB, DIM)}
    h = HEADS
    for i in range(h.layers):
        p = f"model.layers.{i}."
        shapes.update({
            f"{p}self_attn.q_proj.weight": (h.heads * h.head_dim, DIM),
            f"{p}self_attn.k_proj.weight": (h.kv_heads * h.head_dim, DIM),
            f"{p}self_attn.v_proj.weight": (h.kv_heads * h.head_dim, DIM),
            f"{p}self_attn.o_proj.weight": (DIM, h.heads * h.head_dim),
            f"{p}mlp.gate_proj.weight": (FFN, DIM), f"{p}mlp.up_proj.weight": (FFN, DIM),
            f"{p}mlp.down_proj.weight": (DIM, FFN),
            f"{p}input_layernorm.weight": (DIM,), f"{p}post_attention_layernorm.weight": (DIM,),
        })
    out, start = {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(shape).to(dtype)
        start += n
    return out


def test_the_map_is_a_permutation_and_comes_back_bitwise() -> None:
    hf = _hf()
    titan = to_titan(HEADS, hf)
    assert sorted(torch.cat([t.reshape(-1) for t in titan.values()]).tolist()) == \
        sorted(torch.cat([t.reshape(-1) for t in hf.values()]).tolist())
    back = from_titan(HEADS, titan)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_rope_pairs_become_consecutive_rows_within_each_head() -> None:
    """HF's row ``j`` of a head and its rotation partner ``j + d/2`` become torchtitan's rows ``2j`` and ``2j + 1``."""
    d, w = HEADS.head_dim, torch.arange(2 * HEADS.head_dim, dtype=torch.float32).reshape(-1, 1)
    got = interleaved(w, 2).reshape(-1).tolist()
    assert got == [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11] and d == 6
    assert torch.equal(halves(interleaved(w, 2), 2), w)


def test_each_group_holds_its_query_heads_then_its_key_then_its_value() -> None:
    hf, h = _hf(), HEADS
    fused = to_titan(h, hf)[f"layers.1.{WQKV}"].reshape(h.kv_heads, h.heads // h.kv_heads + 2, h.head_dim, DIM)
    p = "model.layers.1.self_attn."
    q = interleaved(hf[f"{p}q_proj.weight"], h.heads).reshape(h.heads, h.head_dim, DIM)
    assert torch.equal(fused[1, 0], q[2]) and torch.equal(fused[1, 1], q[3])  # query heads 2, 3: group 1's
    assert torch.equal(fused[1, 2], interleaved(hf[f"{p}k_proj.weight"], h.kv_heads).reshape(2, 6, DIM)[1])
    assert torch.equal(fused[1, 3], hf[f"{p}v_proj.weight"].reshape(2, 6, DIM)[1])  # values keep their order


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_torchtitans_own_adapter_and_load_hook_make_the_same_parameters() -> None:
    """torchtitan's ``Llama3StateDictAdapter.from_hf`` (its RoPE permutation, wq/wk/wv) loaded by its model's own
    ``load_state_dict`` (the fused-QKV pre-hook): every parameter equals :func:`to_titan`'s, bit for bit."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from osdpipe.layout.models import torchtitan_llama3

    model = torchtitan_llama3(dim=DIM, n_layers=HEADS.layers, n_heads=HEADS.heads, n_kv_heads=HEADS.kv_heads,
                              hidden_dim=FFN, vocab_size=VOCAB)
    hf = _hf()
    theirs = Llama3StateDictAdapter(model.config, None).from_hf(hf)
    model.load_state_dict(theirs, strict=True)
    ours = to_titan(HEADS, hf)
    params = dict(model.named_parameters())
    assert params.keys() == ours.keys()
    assert [n for n, p in params.items() if not torch.equal(p.detach(), ours[n])] == []
