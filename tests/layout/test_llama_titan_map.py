"""Hugging Face's Llama <-> torchtitan's llama3, and its Qwen3 <-> torchtitan's qwen3 (:mod:`osdpipe.layout.
llama_titan`): a permutation of the elements, bitwise both ways, and the same tensors torchtitan's own HF adapter and
its fused-QKV load hook make."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from osdpipe.layout.llama_titan import (
    QWEN3,
    WQKV,
    Heads,
    family_of,
    from_titan,
    halves,
    heads_of,
    hf_config,
    interleaved,
    titan_names_of,
    to_titan,
)

HEADS = Heads(layers=2, heads=4, kv_heads=2, head_dim=6)
#: A qwen3's: its head dimension its own (8 x 4 heads against a hidden size of 24).
QWEN3_HEADS = Heads(layers=2, heads=4, kv_heads=2, head_dim=8, family=QWEN3)
#: A qwen3 whose output layer is the embedding (torchtitan's 0.6B to 4B).
TIED_QWEN3_HEADS = Heads(layers=2, heads=4, kv_heads=2, head_dim=8, family=QWEN3, tied=True)
DIM, FFN, VOCAB = 24, 10, 13


def _hf(dtype: torch.dtype = torch.float32, h: Heads = HEADS) -> dict[str, torch.Tensor]:
    """A Llama's (or, for a qwen3's ``h``, a Qwen3's) state dict whose every element is distinct (its position in one
    long arange); tied, without ``lm_head.weight``, as transformers' tied model holds one parameter."""
    shapes = {"model.embed_tokens.weight": (VOCAB, DIM), "model.norm.weight": (DIM,),
              **({} if h.tied else {"lm_head.weight": (VOCAB, DIM)})}
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
        if h.family.head_norms:
            shapes.update({f"{p}self_attn.q_norm.weight": (h.head_dim,), f"{p}self_attn.k_norm.weight": (h.head_dim,)})
    out, start = {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(shape).to(dtype)
        start += n
    return out


@pytest.mark.parametrize("heads", [HEADS, QWEN3_HEADS, TIED_QWEN3_HEADS], ids=["llama3", "qwen3", "tied qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_map_is_a_permutation_and_comes_back_bitwise(heads: Heads, dtype: torch.dtype) -> None:
    hf = _hf(dtype, heads)
    titan = to_titan(heads, hf)
    assert sorted(torch.cat([t.reshape(-1) for t in titan.values()]).tolist()) == \
        sorted(torch.cat([t.reshape(-1) for t in hf.values()]).tolist())
    back = from_titan(heads, titan)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    assert {t for n in hf for t in titan_names_of(n)} == titan.keys()
    assert ("lm_head.weight" in titan) is not heads.tied  # tied: the embedding is the output layer's one parameter


def test_qwen3_keeps_hfs_row_order_and_takes_each_head_norm_whole() -> None:
    """qwen3's RoPE rotates halves, as transformers' does: its fused rows are HF's q, k, v rows as they are, per
    group; ``q_norm`` and ``k_norm`` are the layer's, whole."""
    h, hf = QWEN3_HEADS, _hf(h=QWEN3_HEADS)
    titan = to_titan(h, hf)
    fused = titan[f"layers.1.{WQKV}"].reshape(h.kv_heads, h.heads // h.kv_heads + 2, h.head_dim, DIM)
    p = "model.layers.1.self_attn."
    q = hf[f"{p}q_proj.weight"].reshape(h.heads, h.head_dim, DIM)
    assert torch.equal(fused[1, 0], q[2]) and torch.equal(fused[1, 1], q[3])
    assert torch.equal(fused[1, 2], hf[f"{p}k_proj.weight"].reshape(2, h.head_dim, DIM)[1])
    assert torch.equal(titan["layers.1.attention.q_norm.weight"], hf[f"{p}q_norm.weight"])
    assert torch.equal(titan["layers.1.attention.k_norm.weight"], hf[f"{p}k_norm.weight"])


def test_model_args_say_their_family_and_its_hugging_face_model() -> None:
    """``model_args.json`` with a ``head_dim`` is torchtitan's qwen3 (``torchtitan_qwen3``'s keywords), a
    ``Qwen3ForCausalLM`` of that head dimension; without, llama3's, a ``LlamaForCausalLM`` of ``dim / n_heads``."""
    llama = {"dim": DIM, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": FFN, "vocab_size": VOCAB}
    qwen3 = {**llama, "head_dim": 8, "norm_eps": 1e-6, "rope_theta": 1e6}
    assert (family_of(llama).factory, family_of(qwen3).factory) == ("torchtitan_llama3", "torchtitan_qwen3")
    assert heads_of(llama) == HEADS and heads_of(qwen3) == QWEN3_HEADS
    config = hf_config(qwen3)
    assert (config["architectures"], config["model_type"], config["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3", 8)
    assert (config["rms_norm_eps"], config["rope_theta"], config["use_sliding_window"]) == (1e-6, 1e6, False)
    assert "mlp_bias" not in config and config["attention_bias"] is False
    assert (hf_config(llama)["architectures"], hf_config(llama)["head_dim"]) == (["LlamaForCausalLM"], 6)
    tied = {**qwen3, "tie_embeddings": True}
    assert heads_of(tied) == TIED_QWEN3_HEADS and hf_config(tied)["tie_word_embeddings"] is True
    assert hf_config(qwen3)["tie_word_embeddings"] is False


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
@pytest.mark.parametrize("heads", [HEADS, QWEN3_HEADS, TIED_QWEN3_HEADS], ids=["llama3", "qwen3", "tied qwen3"])
def test_torchtitans_own_adapter_and_load_hook_make_the_same_parameters(heads: Heads) -> None:
    """torchtitan's own ``Llama3StateDictAdapter.from_hf`` (its RoPE permutation, wq/wk/wv) or
    ``Qwen3StateDictAdapter.from_hf`` (wq/wk/wv, the head norms) loaded by its model's own ``load_state_dict`` (the
    fused-QKV pre-hook): every parameter equals :func:`to_titan`'s, bit for bit."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from osdpipe.layout.models import torchtitan_llama3, torchtitan_qwen3

    dims = {"dim": DIM, "n_layers": heads.layers, "n_heads": heads.heads, "n_kv_heads": heads.kv_heads,
            "hidden_dim": FFN, "vocab_size": VOCAB}
    if heads.family is QWEN3:  # tied, torchtitan's adapter takes the embedding for the head, as transformers does
        model = torchtitan_qwen3(**dims, head_dim=heads.head_dim, tie_embeddings=heads.tied)
        adapter = Qwen3StateDictAdapter
    else:
        model, adapter = torchtitan_llama3(**dims), Llama3StateDictAdapter
    hf = _hf(h=heads)
    theirs = adapter(model.config, None).from_hf(hf)
    model.load_state_dict(theirs, strict=True)
    ours = to_titan(heads, hf)
    params = dict(model.named_parameters())
    assert params.keys() == ours.keys()
    assert [n for n, p in params.items() if not torch.equal(p.detach(), ours[n])] == []


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_a_registry_flavors_keywords_are_read_from_its_config_without_building_it(monkeypatch) -> None:
    """``checkpoint.model=qwen3 checkpoint.flavor=8B`` (torchtitan -> Megatron): the keywords of ``torchtitan_qwen3``
    come from torchtitan's config of the flavor, and the model is never built (an 8B's fp32 weights are 32 GB): a
    small flavor's tied output layer too (qwen3's 0.6B to 4B, llama3's 1B and 3B); an MoE is refused in one line."""
    from torchtitan.models.common.decoder import Decoder

    from osdpipe.layout.models import torchtitan_flavor_args

    def built(self, *args, **kwargs):
        raise AssertionError("the flavor's model was built")

    monkeypatch.setattr(Decoder.Config, "build", built, raising=False)
    args = torchtitan_flavor_args("qwen3", "8B")
    assert family_of(args) is QWEN3
    assert {k: args[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim")} == {
        "dim": 4096, "n_layers": 36, "n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "hidden_dim": 12288}
    assert (args["vocab_size"], args["norm_eps"], args["rope_theta"]) == (151936, 1e-6, 1e6)
    assert family_of(torchtitan_flavor_args("llama3", "8B")).name == "llama3"
    assert "tie_embeddings" not in args and torchtitan_flavor_args("qwen3", "0.6B")["tie_embeddings"] is True
    assert heads_of(torchtitan_flavor_args("llama3", "1B")).tied
    with pytest.raises(ValueError, match="30B-A3B: a mixture of experts; not supported yet"):
        torchtitan_flavor_args("qwen3", "30B-A3B")


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_a_flavor_whose_rope_scaling_its_factory_cannot_take_is_refused(monkeypatch) -> None:
    """``torchtitan_qwen3`` takes no RoPE scaling: a qwen3 config with Llama 3.1's is refused in one line, not written
    unscaled; llama3's is kept as ``rope_scaling``."""
    from osdpipe.layout import models

    real = models.torchtitan_config

    def scaled(name: str, flavor: str):
        config = real(name, flavor)
        config.layers[0].attention.rope.scaling = "llama"
        return config

    monkeypatch.setattr(models, "torchtitan_config", scaled)
    with pytest.raises(ValueError, match="model=torchtitan qwen3 8B: RoPE scaling 'llama'; not supported yet"):
        models.torchtitan_flavor_args("qwen3", "8B")
    assert models.torchtitan_flavor_args("llama3", "debugmodel")["rope_scaling"]["scaling_factor"] == 8.0
    with pytest.raises(ValueError, match="not one of llama3, qwen3"):
        models.torchtitan_flavor_args("deepseek_v3", "debugmodel")
