"""Megatron's GPT, mapped by :mod:`osdpipe.layout.megatron_hf`, is the same function in transformers' Llama.

Real megatron-core 0.16.1 trains the harness's GPT (GQA 4 heads / 2 groups, SwiGLU, RoPE, RMSNorm, untied, vocabulary
1000 padded to 1024) 3 steps on 1 CPU rank, saves it as Megatron-LM saves (:mod:`frameworks.mcore`), and computes its
own logits on fixed tokens (``--logits``: the eval forward of the trained GPTModel). The test oracle reads the save
(:func:`megatron_oracle.read_save`), maps the fp32 masters and the model weights with :func:`to_hf`, and
transformers' ``LlamaForCausalLM(LlamaConfig(**hf_config(args)))`` loads them (``strict``) and computes the logits on
the same tokens.

Tolerance: ``max |HF - Megatron| <= 1e-4 x max |Megatron logit|``. Both run in fp32 on CPU; the weights are the same
bits and the operations the same, so what may differ is the order of rounding in different kernels (transformers'
eager or sdpa attention against Megatron's baddbmm and softmax; torch's RMSNorm against HF's): a few fp32 ulps
(1.2e-7 relative) per operation, through 4 layers of width 64 to 128, of order 1e-6 relative. Measured (torch 2.13.0,
transformers 5.23.0, 2-core CPU): 0 with eager attention (bitwise), 2.4e-7 absolute (3.7e-7 relative, logits up to
0.65) with sdpa; the tolerance leaves a margin of over 100 above that. The wrong maps below (each a mistake a
converter makes) move the logits by 5.5e-3 to 0.96 of their scale here: 55 to 9600 times the tolerance (the test asks
for 10). The smallest, the RoPE permutation and query heads exchanged, are small because 3 steps leave the weights
near their initialisation (std 0.02), where attention is nearly uniform whatever the queries.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from frameworks import mcore
from megatron_oracle import read_save

from osdpipe.io.formats.megatron import gpt_of
from osdpipe.layout.megatron_hf import from_hf, hf_config, to_hf, true_vocab_size

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]

#: max |HF logits - Megatron logits| allowed, relative to max |Megatron logit| (module docstring).
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> dict:
    """The save (read by osdpipe) and Megatron's own logits of the saved model."""
    root = tmp_path_factory.mktemp("megatron_hf")
    folder = mcore.save(root, root / "src", tp=1, pp=1, dp=1, sharding="dp_reshardable", steps=3,
                        logits=root / "logits.pt", timeout=400)
    probe = torch.load(root / "logits.pt", weights_only=True)
    save = read_save(folder)
    vocab = true_vocab_size(save.args)
    assert vocab == mcore.VOCAB and probe["logits"].shape == (2, mcore.SEQ, 1024)
    assert torch.equal(probe["tokens"], mcore.probe_tokens())
    return {"save": save, "gpt": gpt_of(save.args), "vocab": vocab, "tokens": probe["tokens"],
            "logits": probe["logits"][..., :vocab], "root": root}


def _hf_logits(megatron: dict, state: dict[str, torch.Tensor], attention: str = "sdpa") -> torch.Tensor:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**hf_config(megatron["save"].args), attn_implementation=attention)
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(megatron["tokens"]).logits


def _difference(megatron: dict, logits: torch.Tensor) -> float:
    """max |logits - Megatron's|, relative to max |Megatron logit|."""
    assert logits.shape == megatron["logits"].shape
    return float((logits - megatron["logits"]).abs().max() / megatron["logits"].abs().max())


def _masters(megatron: dict) -> dict[str, torch.Tensor]:
    return {key: states["param"] for key, states in megatron["save"].optim.items()}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("weights", ["fp32 masters", "model weights"])
def test_hf_llama_computes_megatrons_logits(megatron: dict, weights: str, attention: str) -> None:
    source = _masters(megatron) if weights == "fp32 masters" else megatron["save"].model
    state = to_hf(megatron["gpt"], source, megatron["vocab"])
    assert all(t.dtype == torch.float32 for t in state.values())
    difference = _difference(megatron, _hf_logits(megatron, state, attention))
    print(f"{weights}, {attention} attention: max |HF - Megatron| / max |logit| = {difference:.3g}")
    assert difference <= RELATIVE_TOLERANCE, f"{weights}, {attention}: relative difference {difference:.3g}"


def _swap_rows(t: torch.Tensor, a: int, b: int, size: int) -> torch.Tensor:
    """``t`` with its blocks ``a`` and ``b`` of ``size`` rows exchanged."""
    order = list(range(t.shape[0]))
    order[a * size:(a + 1) * size], order[b * size:(b + 1) * size] = order[b * size:(b + 1) * size], order[
        a * size:(a + 1) * size]
    return t[order].clone()


def _exchange(s: dict, a: str, b: str) -> None:
    s[a], s[b] = s[b], s[a]


def _per_layer(state: dict, gpt, fn) -> dict:
    state = dict(state)
    for i in range(gpt.num_layers):
        fn(state, f"model.layers.{i}.")
    return state


def _query_heads_of_two_groups_exchanged(state, gpt, masters):
    def fn(s, p):
        s[p + "self_attn.q_proj.weight"] = _swap_rows(s[p + "self_attn.q_proj.weight"], 0, 2, gpt.kv_channels)
    return _per_layer(state, gpt, fn)


def _query_heads_of_one_group_exchanged(state, gpt, masters):
    def fn(s, p):
        s[p + "self_attn.q_proj.weight"] = _swap_rows(s[p + "self_attn.q_proj.weight"], 0, 1, gpt.kv_channels)
    return _per_layer(state, gpt, fn)


def _gate_and_up_exchanged(state, gpt, masters):
    def fn(s, p):
        _exchange(s, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
    return _per_layer(state, gpt, fn)


def _key_and_value_exchanged(state, gpt, masters):
    def fn(s, p):
        _exchange(s, p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight")
    return _per_layer(state, gpt, fn)


def _qkv_cut_as_q_then_k_then_v(state, gpt, masters):
    """linear_qkv read as all query heads, then all keys, then all values (not interleaved per group)."""
    q, kv = gpt.num_attention_heads * gpt.kv_channels, gpt.num_query_groups * gpt.kv_channels
    qkv = masters["decoder.layers.self_attention.linear_qkv.weight"]

    def fn(s, p):
        layer = int(p.split(".")[2])
        s[p + "self_attn.q_proj.weight"] = qkv[layer, :q].clone()
        s[p + "self_attn.k_proj.weight"] = qkv[layer, q:q + kv].clone()
        s[p + "self_attn.v_proj.weight"] = qkv[layer, q + kv:].clone()
    return _per_layer(state, gpt, fn)


def _rope_permuted_as_for_interleaved_checkpoints(state, gpt, masters):
    """q and k permuted as converters of interleaved-RoPE checkpoints (Meta's) do: wrong for Megatron's rotate-half."""
    d = gpt.kv_channels

    def permute(w, heads):
        return w.reshape(heads, d // 2, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape).clone()

    def fn(s, p):
        s[p + "self_attn.q_proj.weight"] = permute(s[p + "self_attn.q_proj.weight"], gpt.num_attention_heads)
        s[p + "self_attn.k_proj.weight"] = permute(s[p + "self_attn.k_proj.weight"], gpt.num_query_groups)
    return _per_layer(state, gpt, fn)


WRONG_MAPS = [_query_heads_of_two_groups_exchanged, _query_heads_of_one_group_exchanged, _gate_and_up_exchanged,
              _key_and_value_exchanged, _qkv_cut_as_q_then_k_then_v, _rope_permuted_as_for_interleaved_checkpoints]


@pytest.mark.parametrize("wrong", WRONG_MAPS, ids=lambda f: f.__name__.strip("_"))
def test_a_wrong_map_is_caught(megatron: dict, wrong) -> None:
    """The comparison is sharp enough: each plausible wrong permutation moves the logits far beyond the tolerance."""
    masters = _masters(megatron)
    state = wrong(to_hf(megatron["gpt"], masters, megatron["vocab"]), megatron["gpt"], masters)
    difference = _difference(megatron, _hf_logits(megatron, state))
    print(f"{wrong.__name__.strip('_')}: max |HF - Megatron| / max |logit| = {difference:.3g}")
    assert difference > 10 * RELATIVE_TOLERANCE, f"{wrong.__name__}: relative difference only {difference:.3g}"


def test_optimizer_states_map_and_come_back_bitwise(megatron: dict) -> None:
    """Masters, exp_avg and exp_avg_sq of the real save go to HF names and back bit for bit (padding rows zero)."""
    gpt, vocab, save = megatron["gpt"], megatron["vocab"], megatron["save"]
    for state in ("param", "exp_avg", "exp_avg_sq"):
        source = {key: states[state] for key, states in save.optim.items()}
        back = from_hf(gpt, to_hf(gpt, source, vocab))
        for key, t in source.items():
            expected = t.clone()
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                expected[vocab:] = 0
            assert torch.equal(back[key].view(torch.int32), expected.view(torch.int32)), f"{state} {key}"


def test_the_written_folder_loads_with_from_pretrained(megatron: dict) -> None:
    """config.json (hf_config) and model.safetensors, loaded by ``from_pretrained``: the same model, the same logits."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    folder = megatron["root"] / "hf"
    folder.mkdir(exist_ok=True)
    (Path(folder) / "config.json").write_text(json.dumps(hf_config(megatron["save"].args), indent=2))
    state = to_hf(megatron["gpt"], _masters(megatron), megatron["vocab"])
    save_file(state, str(folder / "model.safetensors"))
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    assert model.config.rope_parameters["rope_theta"] == 10000.0 and model.dtype == torch.float32
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key], t) for key, t in state.items())
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    assert _difference(megatron, logits) <= RELATIVE_TOLERANCE


def test_the_command_writes_a_folder_that_transformers_loads_and_that_computes_megatrons_logits(
    megatron: dict, tmp_path: Path
) -> None:
    """``osdpipe checkpoint=megatron output.checkpoint=hf``, in a subprocess: ``from_pretrained`` loads the folder, its
    weights are the fp32 masters mapped bitwise, and its logits are Megatron's within the tolerance."""
    from helpers import run_osdpipe
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    done = run_osdpipe("checkpoint=megatron", f"input.path={megatron['save'].folder}", "output.checkpoint=hf",
                       f"output.path={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    model = LlamaForCausalLM.from_pretrained(out).eval()
    expected = to_hf(megatron["gpt"], _masters(megatron), megatron["vocab"])
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key], t) for key, t in expected.items())
    with torch.no_grad():
        difference = _difference(megatron, model(megatron["tokens"]).logits)
    assert difference <= RELATIVE_TOLERANCE, difference


def _titan_logits(megatron: dict, titan: dict[str, torch.Tensor]) -> torch.Tensor:
    """torchtitan's llama3 of the save's dims (``model_args.json``'s keywords), its parameters ``titan``, on the probe
    tokens (positions and causal masks as torchtitan's trainer makes them)."""
    from osdpipe.layout.megatron_hf import titan_args
    from osdpipe.layout.models import torchtitan_llama3

    model = torchtitan_llama3(**titan_args(megatron["save"].args, vocab_size=megatron["vocab"])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(titan[name])
        tokens = megatron["tokens"]
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        return model(tokens, positions, model.get_attention_masks(positions))


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_torchtitan_llama3_computes_megatrons_logits_and_a_missing_rope_permutation_is_caught(megatron: dict) -> None:
    """:func:`osdpipe.layout.llama_titan.to_titan` of the mapped masters, in torchtitan 0.3.0's llama3 (fused ``wqkv``,
    complex RoPE): Megatron's logits within the tolerance (measured 3.2e-7 relative); without the RoPE permutation of q
    and k, 5.5e-3 (55 x the tolerance; the test asks for 10)."""
    from osdpipe.layout import llama_titan

    gpt = megatron["gpt"]
    heads = llama_titan.Heads(gpt.num_layers, gpt.num_attention_heads, gpt.num_query_groups, gpt.kv_channels)
    hf = to_hf(gpt, _masters(megatron), megatron["vocab"])
    right = _difference(megatron, _titan_logits(megatron, llama_titan.to_titan(heads, hf)))
    assert right <= RELATIVE_TOLERANCE, right
    wrong = llama_titan.to_titan(heads, hf)
    for i in range(gpt.num_layers):  # undo the permutation inside the fused tensor: q and k rows as HF orders them
        fused = f"layers.{i}.{llama_titan.WQKV}"
        n, g, d = gpt.num_attention_heads // gpt.num_query_groups, gpt.num_query_groups, gpt.kv_channels
        p = f"model.layers.{i}.self_attn."
        cols = hf[f"{p}q_proj.weight"].shape[1]
        wrong[fused] = torch.cat([hf[f"{p}q_proj.weight"].reshape(g, n, d, cols),
                                  hf[f"{p}k_proj.weight"].reshape(g, 1, d, cols),
                                  hf[f"{p}v_proj.weight"].reshape(g, 1, d, cols)], dim=1).reshape(-1, cols)
    assert _difference(megatron, _titan_logits(megatron, wrong)) >= 10 * RELATIVE_TOLERANCE


def test_output_dtype_casts_the_folder_and_check_proves_the_cast(megatron: dict, tmp_path: Path) -> None:
    """``output.dtype=bfloat16``: ``config.json`` says bfloat16, ``from_pretrained`` loads bfloat16 weights that are the
    fp32 masters mapped and cast (round to nearest even) bit for bit, and ``osdpipe check`` holds them so; the key is
    refused in one line for a training checkpoint, which keeps its masters."""
    from helpers import run_osdpipe
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf16"
    done = run_osdpipe("checkpoint=megatron", f"input.path={megatron['save'].folder}", "output.checkpoint=hf",
                       "output.dtype=bfloat16", f"output.path={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    expected = to_hf(megatron["gpt"], _masters(megatron), megatron["vocab"])
    loaded = model.state_dict()
    assert [k for k, t in expected.items() if not torch.equal(loaded[k], t.to(torch.bfloat16))] == []
    checked = run_osdpipe("check", str(out), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    refused = run_osdpipe("checkpoint=megatron", f"input.path={megatron['save'].folder}", "output.dtype=bfloat16",
                          "target.world_size=1", f"output.path={tmp_path / 'x'}", cwd=tmp_path)
    assert refused.returncode == 2 and "output.dtype=bfloat16 casts a Hugging Face folder" in refused.stderr
    assert not (tmp_path / "x").exists()
