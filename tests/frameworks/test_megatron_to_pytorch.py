"""A Megatron-LM save converts for a PyTorch job of Hugging Face's Llama, the optimizer included (issue 40).

Real megatron-core 0.16.1 trains the test's own GPT (GQA 4 heads in 2 groups, SwiGLU, RoPE, RMSNorm, untied, vocabulary
1000 padded to 1024 x TP) 3 steps at TP2 PP1 DP2 and at TP2 PP2 DP1 and saves it as Megatron-LM does
(:mod:`frameworks.mcore_saves`), beside the state gathered from the live job (the truth). The ``osdpipe`` command
(``checkpoint=megatron output.checkpoint=accelerate``, a subprocess) writes ``save_state``'s SHARDED folder for FSDP2 on
2 ranks with ``config.json`` beside it; accelerate 1.15's own ``load_state``, in a fresh FSDP2 job of
``LlamaForCausalLM`` built from that ``config.json`` (:mod:`frameworks.hf_model_job`), loads it, and then takes a
training step. What it holds after the load must be, bit for bit, the live Megatron job's fp32 master weights and Adam
moments mapped by :func:`osdpipe.layout.megatron_hf.to_hf`, its step and its hyperparameters: the map itself is proven
by both frameworks' logits in ``test_megatron_hf.py``, so the loaded job computes what Megatron's did. A GPT with
its output layer tied to the embedding (``tied_tp2_pp2``) is transformers' tied Llama: one parameter, one optimizer
state; a GPT with a bias on each linear (``tp2_dp2_bias``) a Llama with ``attention_bias`` and ``mlp_bias``, and one
with ``linear_qkv``'s bias alone (``tp2_pp2_qkv_bias``) a ``Qwen2ForCausalLM``, each bias with its Adam state; one
with a norm on each head's query and key (``qwen3_tp2_pp2``: ``--qk-layernorm``) a ``Qwen3ForCausalLM``, whose
``q_norm`` and ``k_norm`` hold the norms' masters and moments.
Megatron-LM's default GPT (``gpt_tp2_pp2``: LayerNorm, a learned position table, GeLU, a bias on each linear, tied)
is transformers' ``GPT2LMHeadModel``, tied as transformers ties it (``test_megatron_hf_biases.py`` proves its logits).
For torchtitan, a GPT is its llama3, or with head norms its qwen3 (both proven against megatron-core's logits), tied
as torchtitan ties; a biased save is refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from frameworks import mcore
from helpers import run_osdpipe

from osdpipe.io.formats.megatron import STATES, gpt_of
from osdpipe.layout.llama_titan import LLAMA3, QWEN3, Heads, to_titan
from osdpipe.layout.megatron_hf import hf_names_of, tied_names, to_hf, true_vocab_size

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]

#: The hyperparameters a torch AdamW group holds, which the converted groups must keep.
ADAMW = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")


def _expected(truth: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The live Megatron job's masters and moments, mapped to Llama's names: state name -> Llama name -> tensor."""
    gpt = gpt_of(truth["args"])
    return {s: to_hf(gpt, {k: states[s] for k, states in truth["optim"].items()}, true_vocab_size(truth["args"]))
            for s in STATES}


def _groups(truth: dict) -> list[list]:
    """The Megatron job's param groups as Llama's: each group's names and its AdamW hyperparameters."""
    names = hf_names_of(gpt_of(truth["args"]))
    return [[[n for key in g["params"] for n in names[key]], {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")}]
            for g in truth["param_groups"]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _differences(loaded: dict, expected: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Every weight and moment of the loaded job that is not the mapped truth, bit for bit."""
    found = [f"weights {n}" for n, want in expected["param"].items()
             if not torch.equal(_bits(loaded["model"][n]), _bits(want))]
    state = loaded["optim"]["state"]
    found += [f"{s} {n}" for s in ("exp_avg", "exp_avg_sq") for n, want in expected[s].items()
              if not torch.equal(_bits(state[n][s]), _bits(want))]
    return found


#: The saves a PyTorch job's model holds, each with the transformers model its ``config.json`` names: a Llama, tied,
#: with a bias on each linear (``--add-bias-linear``), a Qwen2 (``--add-qkv-bias``: q, k and v biased alone),
#: Megatron-LM's default GPT, a GPT-2, a Llama trained over virtual pipeline stages, and a Qwen3 (``--qk-layernorm``).
HF_JOBS = {"tp2_dp2": "LlamaForCausalLM", "tp2_pp2": "LlamaForCausalLM", "tied_tp2_pp2": "LlamaForCausalLM",
           "tp2_dp2_bias": "LlamaForCausalLM", "tp2_pp2_qkv_bias": "Qwen2ForCausalLM",
           "gpt_tp2_pp2": "GPT2LMHeadModel", "tp1_pp2_vpp2_dp2": "LlamaForCausalLM",
           "qwen3_tp2_pp2": "Qwen3ForCausalLM"}
#: Each model's block: the module accelerate's FSDP wraps.
BLOCKS = {"LlamaForCausalLM": "LlamaDecoderLayer", "Qwen2ForCausalLM": "Qwen2DecoderLayer",
          "Qwen3ForCausalLM": "Qwen3DecoderLayer", "GPT2LMHeadModel": "GPT2Block"}
#: Each model's element the comparison is shown to catch: a bias's moment, where the model has biases; a head norm's,
#: in a Qwen3.
WRONG = {"LlamaForCausalLM": "model.layers.1.self_attn.k_proj.", "Qwen2ForCausalLM": "model.layers.1.self_attn.k_proj.",
         "Qwen3ForCausalLM": "model.layers.1.self_attn.q_norm.", "GPT2LMHeadModel": "transformer.h.1.attn.c_attn."}


@pytest.mark.parametrize("name", sorted(HF_JOBS))
def test_accelerate_resumes_a_megatron_save_converted_for_a_hugging_face_model(
    megatron_saves: dict[str, Path], name: str, tmp_path: Path
) -> None:
    from frameworks import accel

    folder = megatron_saves[name]
    truth = torch.load(mcore.truth_path(folder), weights_only=False)
    out = tmp_path / "out"
    done = run_osdpipe("checkpoint=megatron", f"input.path={folder}", "output.checkpoint=accelerate",
                       "target.kind=fsdp2", "target.world_size=2", f"output.path={out}", cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (out / "dcp").iterdir()) == [
        "config.json", "megatron.pt", "optimizer_0", "pytorch_model_fsdp_0"]
    carried = torch.load(out / "dcp" / "megatron.pt", weights_only=True)
    assert carried["iteration"] == truth["iteration"] == 3
    assert carried["opt_param_scheduler"] == truth["scheduler"]

    config = json.loads((out / "dcp" / "config.json").read_text())
    assert config["architectures"] == [HF_JOBS[name]]
    job = {"model": "frameworks.hf_model_job:logits_model", "kwargs": {"config": str(out / "dcp" / "config.json")},
           "wrap": BLOCKS[HF_JOBS[name]], "groups": _groups(truth)}
    loaded = accel.load(tmp_path, 2, out / "dcp", fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", tied=False,
                        steps=3, job=job, timeout=400)
    expected, gpt = _expected(truth), gpt_of(truth["args"])
    biases = sorted(n.rsplit(".", 2)[-2] for n in expected["param"] if n.startswith("model.layers.0.")
                    and n.endswith(".bias"))
    assert biases == {"tp2_dp2_bias": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
                      "tp2_pp2_qkv_bias": ["k_proj", "q_proj", "v_proj"]}.get(name, [])
    if gpt.tied:  # Llama 3.2's, GPT-2's: lm_head is the embedding, one parameter, one optimizer state
        assert config["tie_word_embeddings"] is True and name in ("tied_tp2_pp2", "gpt_tp2_pp2")
        embedding_name, output_name = tied_names(gpt)
        assert output_name not in expected["param"] and output_name not in loaded["optim"]["state"]
        embedding = loaded["model"][embedding_name]
        assert torch.equal(_bits(loaded["model"].pop(output_name)), _bits(embedding))
    assert sorted(loaded["model"]) == sorted(expected["param"])
    assert _differences(loaded, expected) == []
    assert {float(s["step"]) for s in loaded["optim"]["state"].values()} == {3.0}
    for got, want in zip(loaded["param_groups"], truth["param_groups"]):
        assert {k: got[k] for k in ADAMW} == {k: (tuple(want[k]) if k == "betas" else want[k]) for k in ADAMW}
    assert math.isfinite(loaded["loss_after"])  # it trains on

    # the comparison sees one element that is not the truth's (a bias's, where the model has them)
    wrong = WRONG[HF_JOBS[name]] + ("bias" if biases or name.startswith("gpt") else "weight")
    expected["exp_avg_sq"][wrong].view(-1)[5] += 1
    assert _differences(loaded, expected) == [f"exp_avg_sq {wrong}"]


#: Each source torchtitan takes: its model there, the job building it from ``model_args.json`` (:mod:`frameworks.
#: titan_llama_job`). A GPT with head norms (``--qk-layernorm``) is torchtitan's qwen3, one without its llama3; a tied
#: GPT (``tied_tp2_pp2``: the last stage's output layer a copy of the embedding) a llama3 with ``enable_weight_tying``.
TITAN_JOBS = {"tp2_pp2": (LLAMA3, "megatron_llama3"), "qwen3_tp2_pp2": (QWEN3, "megatron_qwen3"),
              "tied_tp2_pp2": (LLAMA3, "megatron_llama3")}


@pytest.fixture(scope="module")
def in_torchtitan(megatron_saves: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """``output.checkpoint=torchtitan`` of a source of :data:`TITAN_JOBS` (``step-3`` and ``model_args.json`` beside
    it), loaded by torchtitan 0.3.0's own ``CheckpointManager`` into a 2-rank FSDP2 job of its model built from those
    args, which then takes a step; each source once, when a test first asks: the output folder, what the job held
    after the load (:mod:`frameworks.titan_load`) and the live Megatron job's state mapped for it."""
    import re

    from frameworks import titan_load
    from frameworks.launch import run_logged, torchrun, worker_env

    done: dict[str, dict] = {}

    def resumed(name: str) -> dict:
        if name in done:
            return done[name]
        family, job = TITAN_JOBS[name]
        folder, work = megatron_saves[name], tmp_path_factory.mktemp(f"titan_{name}")
        truth = torch.load(mcore.truth_path(folder), weights_only=False)
        out = work / "out"
        ran = run_osdpipe("checkpoint=megatron", f"input.path={folder}", "output.checkpoint=torchtitan",
                          "target.kind=fsdp2", "target.world_size=2", f"output.path={out}", cwd=work, timeout=400)
        assert ran.returncode == 0, ran.stderr[-3000:]
        gpt = gpt_of(truth["args"])
        heads = Heads(gpt.num_layers, gpt.num_attention_heads, gpt.num_query_groups, gpt.kv_channels, family, gpt.tied)
        expected = {s: to_titan(heads, states) for s, states in _expected(truth).items()}
        norms = [n for n in expected["param"] if n.endswith("norm.weight")]
        groups = [["^(" + "|".join(re.escape(n) for n in names) + ")$", kwargs] for names, kwargs in (
            (norms, {"lr": truth["param_groups"][1]["lr"], "weight_decay": 0.0}),
            ([n for n in expected["param"] if n not in norms],
             {"lr": truth["param_groups"][0]["lr"], "weight_decay": 0.1}),
        )]
        spec = {"folder": str(out), "model": f"frameworks.titan_llama_job:{job}",
                "kwargs": {"args": str(out / "model_args.json")}, "groups": groups,
                "exclude": ["dataloader", "lr_scheduler", "train_state"], "dump": str(work / "titan_loaded.pt")}
        run_logged(torchrun(2, Path(titan_load.__file__), spec), work, label="titan-load", timeout=400,
                   what="torchtitan's load of", env=worker_env())
        done[name] = {"out": out, "expected": expected, "job": job,
                      "loaded": torch.load(spec["dump"], weights_only=False)}
        return done[name]

    return resumed


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
@pytest.mark.parametrize("name", TITAN_JOBS)
def test_torchtitan_resumes_a_megatron_save_converted_to_its_step_folder(in_torchtitan, name: str) -> None:
    """torchtitan's job (llama3: fused ``wqkv``, complex RoPE; qwen3: fused ``wqkv``, rotate-half RoPE, head norms;
    tied: one parameter, ``tok_embeddings``, its ``lm_head`` the same) holds the live Megatron job's masters and
    moments mapped (fused, RoPE-permuted for llama3; the head norms whole for qwen3) bit for bit, step 3, and trains
    on. That llama3's permuted model computes Megatron's logits is ``test_megatron_hf.py``'s, qwen3's the next
    test's."""
    from frameworks.titan_llama_job import parameters

    run = in_torchtitan(name)
    loaded = run["loaded"]
    assert sorted(p.name for p in run["out"].iterdir()) == ["manifest.json", "model_args.json", "osdpipe.log",
                                                             "report.json", "step-3"]
    assert loaded["found"] and math.isfinite(loaded["loss"])
    args = json.loads((run["out"] / "model_args.json").read_text())
    assert _differences({"model": parameters(loaded["model"], args), "optim": loaded["optim"]}, run["expected"]) == []
    assert {float(s["step"]) for s in loaded["optim"]["state"].values()} == {3.0}
    tied = bool(args.get("tie_embeddings"))
    assert tied == (name == "tied_tp2_pp2") and ("lm_head.weight" in loaded["optim"]["state"]) is not tied
    assert torch.equal(loaded["model"]["lm_head.weight"], loaded["model"]["tok_embeddings.weight"]) is tied


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_torchtitans_qwen3_of_the_step_folder_computes_megatrons_logits(in_torchtitan, megatron_logits) -> None:
    """The qwen3 torchtitan loaded from a Megatron Qwen3 save (``--qk-layernorm``), built from ``model_args.json`` by
    torchtitan's own config classes, computes megatron-core's logits of the save on the probe tokens within
    ``1e-4 x max |logit|`` (fp32; ``test_megatron_hf.py`` says why); without its head norms (what a llama3, which
    norms no query or key, computes of the same weights) the logits move by more than 10 times that."""
    from frameworks import titan_llama_job

    run = in_torchtitan("qwen3_tp2_pp2")
    probe = megatron_logits["qwen3_tp2_pp2"]
    model = titan_llama_job.megatron_qwen3(str(run["out"] / "model_args.json")).eval()
    model.load_state_dict(run["loaded"]["model"], strict=True)  # its own hooks fuse wq, wk, wv
    megatron, scale = probe["logits"][..., : mcore.VOCAB], float(probe["logits"].abs().max())
    with torch.no_grad():
        diff = float((model(probe["tokens"]) - megatron).abs().max())
        for block in model.blocks:
            block.attention.q_norm = block.attention.k_norm = torch.nn.Identity()
        moved = float((model(probe["tokens"]) - megatron).abs().max())
    print(f"max |Megatron - torchtitan qwen3| = {diff:.3g}, without head norms: {moved:.3g}, max |logit| = {scale:.3g}")
    assert diff <= 1e-4 * scale
    assert moved > 10 * 1e-4 * scale


@pytest.mark.parametrize("name", ["tp2_pp2", "gpt_tp2_pp2"])
def test_pytorchs_own_layout_passes_every_check_of_a_live_fsdp2_world(megatron_saves: dict[str, Path],
                                                                      tmp_path: Path, name: str) -> None:
    """``output.checkpoint=pytorch`` online: osdpipe's reference (PyTorch's own ``set_optimizer_state_dict`` into FSDP2
    on 2 ranks), load_step and resume checks pass, and ``osdpipe check`` holds the output against the save; for a
    Llama, and for Megatron-LM's default GPT, transformers' GPT-2 (one tied parameter)."""
    import json

    out = tmp_path / "out"
    done = run_osdpipe("checkpoint=megatron", f"input.path={megatron_saves[name]}", "output.checkpoint=pytorch",
                       "target.kind=fsdp2", "target.world_size=2", "runtime.mode=online", f"output.path={out}",
                       cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {c["name"]: c["ok"] for c in report["checks"]} == {
        "roundtrip": True, "reference": True, "load_step": True, "resume": True}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dcp", "manifest.json", "osdpipe.log",
                                                      "report.json"]
    fates = {e["name"]: e["fate"] for e in report["entries"]}
    assert fates["common.pt args"].startswith("left out") and fates["common.pt iteration"].startswith("carried")
    checked = run_osdpipe("check", str(out), cwd=tmp_path, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
@pytest.mark.parametrize("name, feature", [
    ("tp2_dp2_bias", "linear biases (add_bias_linear or add_qkv_bias: torchtitan's llama3 has none)"),
    ("gpt_tp2_pp2", "LayerNorm (not RMSNorm)"),
])
def test_what_torchtitan_cannot_hold_is_refused_in_one_line_naming_the_jobs_that_take_it(
    megatron_saves: dict[str, Path], tmp_path: Path, name: str, feature: str
) -> None:
    """torchtitan's llama3 and qwen3 have unbiased linears, and a llama3 norms a model's hidden state alone (not
    LayerNorm): such a save is refused before anything is written, and the line names the outputs that take it (a
    Hugging Face model's job)."""
    out = tmp_path / "out"
    done = run_osdpipe("checkpoint=megatron", f"input.path={megatron_saves[name]}",
                       "output.checkpoint=torchtitan", "target.kind=fsdp2", "target.world_size=2", f"output.path={out}",
                       cwd=tmp_path, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode != 0 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert feature in errors[0] and "output.checkpoint=accelerate|pytorch" in errors[0]
    assert not (out / "manifest.json").exists() and not list(out.glob("step-*"))


@pytest.mark.parametrize("name, change, feature", [
    ("tp2_dp2", {"squared_relu": True}, "squared ReLU"),
    ("tp2_pp2_qkv_bias", {"use_rope_scaling": True}, "RoPE scaling with linear_qkv's bias alone (a Qwen2)"),
])
def test_what_llama_cannot_express_is_refused_in_one_line_and_nothing_is_written(
    megatron_saves: dict[str, Path], tmp_path: Path, name: str, change: dict, feature: str
) -> None:
    source = tmp_path / "src"
    shutil.copytree(megatron_saves[name], source)
    common = next(source.glob("iter_*")) / "common.pt"
    held = torch.load(common, weights_only=False)  # the test's own save: its Namespace unpickled
    for key, value in change.items():
        setattr(held["args"], key, value)
    torch.save(held, common, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    out = tmp_path / "out"
    done = run_osdpipe("checkpoint=megatron", f"input.path={source}", "output.checkpoint=pytorch",
                       "target.kind=fsdp2", "target.world_size=2", f"output.path={out}", cwd=tmp_path, timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and feature in errors[0] and "Traceback" not in done.stderr, done.stderr
    assert not (out / "dcp").exists() and not (out / "manifest.json").exists()
