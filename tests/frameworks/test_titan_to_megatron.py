"""A torchtitan checkpoint of llama3 -> a Megatron-LM save at TP2 PP2 DP1, optimizer included (issue 40).

torchtitan 0.3.0's own pieces train its llama3 (fused ``wqkv``, complex RoPE; GQA 4 heads in 2 key/value heads, the
harness GPT's dimensions: vocabulary 1000, which Megatron pads to 1024 at TP2) 3 steps with FSDP2 on 2 CPU ranks, and
its ``CheckpointManager`` saves ``step-3`` (:mod:`frameworks.titan_save`; the model's dimensions in ``model_args.json``
beside it, torchtitan's own config classes building it). The ``osdpipe`` command converts the folder
(``checkpoint=torchtitan output.checkpoint=megatron``: to transformers' Llama by :mod:`osdpipe.layout.llama_titan`,
then to Megatron's GPT by :mod:`osdpipe.layout.megatron_hf`, both copy-only). The real megatron-core 0.16.1 job,
built with the save's own dimensions and loading as Megatron-LM's ``load_checkpoint --no-load-rng`` does, loads it at
TP2 PP2 and:

(a) holds, gathered, the masters, ``exp_avg``, ``exp_avg_sq``, the weights and the step of the live torchtitan job,
    mapped, bitwise;
(b) computes, through its pipeline schedule, the logits torchtitan's own forward of the saved model computes on the
    same tokens, within ``max |diff| <= 1e-4 x max |logit|`` (fp32; ``test_megatron_hf.py`` says why);
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

from osdpipe.layout.llama_titan import from_titan, heads_of
from osdpipe.layout.megatron import Gpt
from osdpipe.layout.megatron_hf import from_hf

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed"),
]

#: torchtitan's llama3 of the harness GPT's dimensions (``osdpipe.layout.models.torchtitan_llama3``'s keywords).
ARGS = {"dim": mcore.HIDDEN, "n_layers": mcore.LAYERS, "n_heads": mcore.HEADS, "n_kv_heads": mcore.GROUPS,
        "hidden_dim": mcore.FFN, "vocab_size": mcore.VOCAB, "norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_seq_len": mcore.SEQ}
#: The GPT Megatron builds of it at TP2 (vocabulary padded to 128 x 2).
GPT = Gpt(num_layers=mcore.LAYERS, hidden_size=mcore.HIDDEN, ffn_hidden_size=mcore.FFN, num_attention_heads=mcore.HEADS,
          num_query_groups=mcore.GROUPS, kv_channels=mcore.HIDDEN // mcore.HEADS, padded_vocab_size=1024, swiglu=True)
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """torchtitan's step-3, its conversion to TP2 PP2 DP1, and what megatron-core made of it."""
    from frameworks import titan_save
    from frameworks.launch import run_logged, torchrun, worker_env

    work = tmp_path_factory.mktemp("titan_to_megatron")
    folder = work / "titan"
    folder.mkdir()
    (folder / "model_args.json").write_text(json.dumps(ARGS))
    spec = {"folder": str(folder), "args": str(folder / "model_args.json"), "steps": 3, "lr": 1e-3,
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
    return {"work": work, "out": out, "truth": torch.load(work / "truth.pt", weights_only=False),
            "loaded": torch.load(work / "loaded.pt", weights_only=False),
            "after": torch.load(work / "after.pt", weights_only=False),
            "logits": torch.load(work / "logits.pt", weights_only=True)}


def test_megatron_holds_torchtitans_masters_moments_and_step_bitwise(run) -> None:
    from frameworks.titan_llama_job import parameters

    truth, loaded, heads = run["truth"], run["loaded"], heads_of(ARGS)
    state = truth["optim"]["state"]
    titan = {"param": parameters(truth["model"], ARGS),
             **{s: {n: v[s] for n, v in state.items()} for s in ("exp_avg", "exp_avg_sq")}}
    want = {s: from_hf(GPT, from_titan(heads, tensors)) for s, tensors in titan.items()}
    differ = [f"{s} {k}" for s, tensors in want.items() for k, t in tensors.items()
              if not torch.equal(t, loaded["optim"][k][s])]
    differ += [f"model {k}" for k, t in want["param"].items() if not torch.equal(t, loaded["model"][k])]
    assert differ == []
    assert {float(s["step"]) for s in loaded["optim"].values()} == {3.0} and loaded["iteration"] == 3
    # one element wrong: the comparison sees it
    want["exp_avg"]["output_layer.weight"].view(-1)[3] += 1
    assert not torch.equal(want["exp_avg"]["output_layer.weight"], loaded["optim"]["output_layer.weight"]["exp_avg"])


def test_megatrons_logits_are_torchtitans(run) -> None:
    from frameworks.titan_llama_job import megatron_llama3

    model = megatron_llama3(str(run["out"].parent / "titan" / "model_args.json")).eval()
    model.load_state_dict(run["truth"]["model"], strict=True)  # its own hooks fuse wq, wk, wv
    tokens, logits = run["logits"]["tokens"], run["logits"]["logits"]
    with torch.no_grad():
        reference = model(tokens)
    diff = float((logits[..., : ARGS["vocab_size"]] - reference).abs().max())
    scale = float(reference.abs().max())
    print(f"max |Megatron TP2 PP2 - torchtitan| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale


def test_megatron_trains_on_from_the_converted_save(run) -> None:
    assert mcore.trained_on(run["loaded"], run["after"], step=3) == []
