"""A torchtitan checkpoint of llama3 or qwen3 -> a Megatron-LM save at TP2 PP2 DP1, optimizer included (issue 40).

torchtitan 0.3.0's own pieces train its llama3 (fused ``wqkv``, complex RoPE; GQA 4 heads in 2 key/value heads, the
harness GPT's dimensions: vocabulary 1000, which Megatron pads to 1024 at TP2) or its qwen3 (fused ``wqkv``,
rotate-half RoPE, a norm of each head's query and key, heads of 12 against a hidden size of 48) 3 steps with FSDP2 on
2 CPU ranks, and its ``CheckpointManager`` saves ``step-3`` (:mod:`frameworks.titan_save`; the model's dimensions in
``model_args.json`` beside it, torchtitan's own config classes building it). The ``osdpipe`` command converts the
folder (``checkpoint=torchtitan output.checkpoint=megatron``: to transformers' Llama or Qwen3 by
:mod:`osdpipe.layout.llama_titan`, then to Megatron's GPT by :mod:`osdpipe.layout.megatron_hf`, both copy-only). The
real megatron-core 0.16.1 job, built with the save's own dimensions (``--qk-layernorm --kv-channels 12`` for the qwen3)
and loading as Megatron-LM's ``load_checkpoint --no-load-rng`` does, loads it at TP2 PP2 and:

(a) holds, gathered, the masters, ``exp_avg``, ``exp_avg_sq``, the weights and the step of the live torchtitan job,
    mapped, bitwise;
(b) computes, through its pipeline schedule, the logits torchtitan's own forward of the saved model computes on the
    same tokens, within ``max |diff| <= 1e-4 x max |logit|`` (fp32; ``test_megatron_hf.py`` says why); for the qwen3,
    torchtitan's forward without its head norms is more than 10 times that away (a map that lost them);
(c) takes a training step from there: step and iteration 4, every master moved, all finite.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from frameworks import mcore
from helpers import run_osdpipe

from osdpipe.layout.llama_titan import LLAMA3, QWEN3, Heads, from_titan
from osdpipe.layout.megatron import Gpt
from osdpipe.layout.megatron_hf import from_hf

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed"),
]

#: torchtitan's llama3 of the harness GPT's dimensions (``osdpipe.layout.models.torchtitan_llama3``'s keywords).
LLAMA3_ARGS = {"dim": mcore.HIDDEN, "n_layers": mcore.LAYERS, "n_heads": mcore.HEADS, "n_kv_heads": mcore.GROUPS,
               "hidden_dim": mcore.FFN, "vocab_size": mcore.VOCAB, "norm_eps": 1e-5, "rope_theta": 10000.0,
               "max_seq_len": mcore.SEQ}
#: Its qwen3 (``torchtitan_qwen3``'s keywords): heads of its own dimension (12 x 4 against a hidden size of 48),
#: normed as Qwen3's.
QWEN3_ARGS = {**LLAMA3_ARGS, "head_dim": 12, "norm_eps": 1e-6, "rope_theta": 1000000.0}
#: Each model: its ``model_args.json``, its builder in :mod:`frameworks.titan_llama_job`, the torchtitan family. The
#: tied qwen3 is as torchtitan's 0.6B to 4B (``enable_weight_tying``): its output layer the embedding.
MODELS = {"llama3": (LLAMA3_ARGS, "megatron_llama3", LLAMA3), "qwen3": (QWEN3_ARGS, "megatron_qwen3", QWEN3),
          "tied qwen3": ({**QWEN3_ARGS, "tie_embeddings": True}, "megatron_qwen3", QWEN3)}
RELATIVE_TOLERANCE = 1e-4


def _gpt(args: dict) -> Gpt:
    """The GPT Megatron builds of torchtitan's model of ``args`` at TP2 (vocabulary padded to 128 x 2)."""
    return Gpt(num_layers=mcore.LAYERS, hidden_size=mcore.HIDDEN, ffn_hidden_size=mcore.FFN,
               num_attention_heads=mcore.HEADS, num_query_groups=mcore.GROUPS,
               kv_channels=args.get("head_dim", mcore.HIDDEN // mcore.HEADS), padded_vocab_size=1024, swiglu=True,
               qk_layernorm="head_dim" in args, tied=bool(args.get("tie_embeddings")))


@pytest.fixture(scope="module", params=MODELS)
def run(request, tmp_path_factory) -> dict:
    """torchtitan's step-3 of one of :data:`MODELS`, its conversion to TP2 PP2 DP1, and what megatron-core made of
    it."""
    from frameworks import titan_save
    from frameworks.launch import run_logged, torchrun, worker_env

    args, job, family = MODELS[request.param]
    work = tmp_path_factory.mktemp(f"titan_to_megatron_{request.param.replace(' ', '_')}")
    folder = work / "titan"
    folder.mkdir()
    (folder / "model_args.json").write_text(json.dumps(args))
    spec = {"folder": str(folder), "model": job, "args": str(folder / "model_args.json"), "steps": 3, "lr": 1e-3,
            "dump": str(work / "truth.pt")}
    run_logged(torchrun(2, Path(titan_save.__file__), spec), work, label="titan-save", timeout=400,
               what="torchtitan's save of", env=worker_env())
    out = work / "megatron"
    done = run_osdpipe("checkpoint=torchtitan", f"input.path={folder}", "output.checkpoint=megatron",
                       "target.tp_size=2", "target.pp_size=2", "target.world_size=4", f"output.path={out}", cwd=work,
                       timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    mcore.load(work, out, work / "loaded.pt", tp=2, pp=2, dp=1, dims_from_save=True, no_load_rng=True,
               logits=work / "logits.pt", resume=1, dump_after=work / "after.pt", label="load-titan-tp2pp2")
    return {"work": work, "out": out, "args": args, "job": job, "family": family,
            "truth": torch.load(work / "truth.pt", weights_only=False),
            "loaded": torch.load(work / "loaded.pt", weights_only=False),
            "after": torch.load(work / "after.pt", weights_only=False),
            "logits": torch.load(work / "logits.pt", weights_only=True)}


def test_megatron_holds_torchtitans_masters_moments_and_step_bitwise(run) -> None:
    from frameworks.titan_llama_job import parameters

    truth, loaded, args = run["truth"], run["loaded"], run["args"]
    heads = Heads(mcore.LAYERS, mcore.HEADS, mcore.GROUPS, args.get("head_dim", mcore.HIDDEN // mcore.HEADS),
                  run["family"], bool(args.get("tie_embeddings")))
    state = truth["optim"]["state"]
    titan = {"param": parameters(truth["model"], args),
             **{s: {n: v[s] for n, v in state.items()} for s in ("exp_avg", "exp_avg_sq")}}
    want = {s: from_hf(_gpt(args), from_titan(heads, tensors)) for s, tensors in titan.items()}
    differ = [f"{s} {k}" for s, tensors in want.items() for k, t in tensors.items()
              if not torch.equal(t, loaded["optim"][k][s])]
    differ += [f"model {k}" for k, t in want["param"].items() if not torch.equal(t, loaded["model"][k])]
    assert differ == []
    assert {float(s["step"]) for s in loaded["optim"].values()} == {3.0} and loaded["iteration"] == 3
    # one element wrong: the comparison sees it
    assert ("output_layer.weight" in loaded["optim"]) is not bool(args.get("tie_embeddings"))  # tied: the embedding
    embedding = "embedding.word_embeddings.weight"
    want["exp_avg"][embedding].view(-1)[3] += 1
    assert not torch.equal(want["exp_avg"][embedding], loaded["optim"][embedding]["exp_avg"])


def test_megatrons_logits_are_torchtitans(run) -> None:
    from frameworks import titan_llama_job

    model = getattr(titan_llama_job, run["job"])(str(run["out"].parent / "titan" / "model_args.json")).eval()
    model.load_state_dict(run["truth"]["model"], strict=True)  # its own hooks fuse wq, wk, wv
    tokens, logits = run["logits"]["tokens"], run["logits"]["logits"][..., : mcore.VOCAB]
    with torch.no_grad():
        reference = model(tokens)
        if run["family"].head_norms:  # what a map that lost them computes: far off
            for block in model.blocks:
                block.attention.q_norm = block.attention.k_norm = torch.nn.Identity()
            moved = float((logits - model(tokens)).abs().max())
            print(f"without its head norms, torchtitan's {run['family'].name} is {moved:.3g} off")
            assert moved > 10 * RELATIVE_TOLERANCE * float(reference.abs().max())
    diff = float((logits - reference).abs().max())
    scale = float(reference.abs().max())
    print(f"max |Megatron TP2 PP2 - torchtitan {run['family'].name}| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale


def test_megatron_trains_on_from_the_converted_save(run) -> None:
    assert mcore.trained_on(run["loaded"], run["after"], step=3) == []
