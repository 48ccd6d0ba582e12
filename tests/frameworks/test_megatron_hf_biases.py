"""A Megatron GPT with linear biases or head norms is a Hugging Face model that computes its logits: a Llama with
``attention_bias`` and ``mlp_bias`` (Megatron-LM's ``--add-bias-linear``), a Qwen2 (``--add-qkv-bias``:
``linear_qkv``'s bias alone), a Qwen3 (``--qk-layernorm``: a norm on each head's query and key), and Megatron-LM's
default GPT (LayerNorm, a learned position table, GeLU, every linear biased, tied embeddings) a GPT-2.

The sources are real megatron-core 0.16.1 saves of the harness's GPT with those biases (``tp2_dp2_bias``,
``tp2_pp2_qkv_bias`` of :mod:`frameworks.mcore_saves`) or head norms (``qwen3_tp2_pp2``) and of Megatron-LM's default
GPT (``gpt_tp2_pp2``), trained 3 steps on 4 ranks. The ``osdpipe`` command writes each as a model folder
(``output.checkpoint=hf``); transformers 5.23.0 loads it by its ``config.json`` (``AutoModelForCausalLM``: the class its
``architectures`` names), and its logits on fixed tokens must be the ones megatron-core itself computes from the save
(loaded at the save's own grid, as Megatron-LM's ``load_checkpoint`` does), within ``max |diff| <= 1e-4 x max |logit|``
(fp32; test_megatron_hf.py says why). The biases are what a map that lost them would miss: zeroed, the folder's logits
move by 140 times the tolerance or more (measured: 0.014 of their scale for the Qwen2's, 0.41 for the Llama's); so are
the head norms: the same weights in a Llama, which norms no query or key, move the Qwen3's logits by far more than the
tolerance. The HF -> Megatron direction is in test_hf_folder_to_megatron.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from frameworks import mcore
from frameworks.mcore_saves import SAVES
from helpers import run_osdpipe
from megatron_oracle import read_save

from osdpipe.io.formats.megatron import gpt_of
from osdpipe.io.hf_folder import read_weights
from osdpipe.layout.megatron_hf import from_hf

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]

RELATIVE_TOLERANCE = 1e-4
#: Each source and the Hugging Face class its folder must be (each one of ``conftest.LOGITS_OF``).
ARCHITECTURES = {"tp2_dp2_bias": "LlamaForCausalLM", "tp2_pp2_qkv_bias": "Qwen2ForCausalLM",
                 "gpt_tp2_pp2": "GPT2LMHeadModel", "qwen3_tp2_pp2": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("name, architecture", ARCHITECTURES.items())
def test_a_biased_or_head_normed_megatron_save_is_a_hugging_face_model_that_computes_its_logits(
    megatron_saves: dict[str, Path], megatron_logits: dict[str, dict], name: str, architecture: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    source = megatron_saves[name]
    out = tmp_path / "hf"
    done = run_osdpipe("checkpoint=megatron", f"input.path={source}", "output.checkpoint=hf", f"output.path={out}",
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    megatron = read_save(source)
    gpt = gpt_of(megatron.args)
    back = from_hf(gpt, read_weights(out))  # the folder holds every fp32 master, biases included, bitwise
    vocab = mcore.VOCAB
    masters = {key: states["param"] for key, states in megatron.optim.items()}
    feature = "self_attention.q_layernorm.weight" if SAVES[name].qk else ".bias"  # what the family adds to a Llama
    assert any(key.endswith(feature) for key in masters)
    assert [k for k, t in masters.items() if not torch.equal(back[k][:vocab], t[:vocab])] == []

    probe = megatron_logits[name]
    diff, scale = mcore.hf_logits_gap(out, probe)
    print(f"{name}: max |Megatron - HF {architecture}| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale

    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(model).__name__ == architecture
    with torch.no_grad():
        without = _without_its_feature(model, out)(probe["tokens"]).logits
    moved = float((without - probe["logits"][..., :vocab]).abs().max())
    print(f"{name}: without its biases or head norms the logits move by {moved:.3g}")
    assert moved > 10 * RELATIVE_TOLERANCE * scale, moved  # the comparison above sees the biases, or the head norms


def _without_its_feature(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """The folder's model without what its family adds to a Llama: its biases zeroed, or, a Qwen3, its weights in a
    ``LlamaForCausalLM`` (which norms no query or key): what a map that lost them computes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if type(model).__name__ != "Qwen3ForCausalLM":
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.zero_()
        return model
    config = json.loads((folder / "config.json").read_text())
    kept = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    llama = LlamaForCausalLM(LlamaConfig(**kept, attn_implementation="eager")).eval()
    weights = {k: v for k, v in read_weights(folder).items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    llama.load_state_dict(weights, strict=True)
    return llama
