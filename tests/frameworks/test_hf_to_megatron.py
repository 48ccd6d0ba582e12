"""The HF Trainer's checkpoint of a Llama -> a Megatron-LM save at TP2 PP2 DP1, optimizer included (issue 40).

The real HF Trainer (transformers 5.23.0, accelerate 1.15.0) trains the tests' own ``LlamaForCausalLM`` (GQA: 4 heads
in 2 key/value heads, untied embeddings, vocabulary 50, which Megatron pads to 256 at TP2; 4 layers) with FSDP2 on 2
CPU ranks and saves ``checkpoint-3`` mid-schedule (its learning rate not yet 0). The ``osdpipe`` command converts it
(``checkpoint=accelerate output.checkpoint=megatron``), the model's dimensions from its ``config.json``. The real
megatron-core 0.16.1 job (:mod:`frameworks.mcore`, built with the save's own dimensions, loading as Megatron-LM's
``load_checkpoint --no-load-rng`` does) loads it on 4 ranks at TP2 PP2 and:

(a) holds, gathered, the fp32 masters, ``exp_avg``, ``exp_avg_sq``, the model's weights and the step that the Trainer's
    own files hold (read here with ``torch.load``, mapped by ``from_hf``), bitwise;
(b) computes, through its pipeline schedule, logits on fixed tokens that transformers' own forward of the checkpoint
    (``from_pretrained``, eager attention) computes, within ``max |diff| <= 1e-4 x max |logit|`` (fp32, the tolerance
    of ``test_megatron_hf.py``; measured about 1e-7);
(c) takes a training step from there (a synthetic gradient): step 4, iteration 4, the masters moved, all finite.

Converted for PP2 with 2 model chunks per stage (``target.vpp_size=2``, DP2), megatron-core's interleaved chunks hold
(a) and take (c) too.

The same Llama tied (``tie_word_embeddings``, as Llama 3.2's 1B and 3B) holds (a) to (c) too, Megatron's tied embedding
with no output layer of its own, the last stage's copy equal to it; and so does a ``Qwen2ForCausalLM`` of the same
dimensions (Qwen2.5's architecture: biases on q, k and v), Megatron's ``add_qkv_bias`` GPT, each bias with its moments;
and a ``Qwen3ForCausalLM`` (a norm on each head's query and key, heads of 12), Megatron's ``qk_layernorm`` GPT, each
norm with its moments; and a ``GPT2LMHeadModel`` (tied, as transformers builds it), Megatron-LM's default GPT
(LayerNorm, a learned position table, the tanh GeLU, a bias on every linear), Conv1D's transposed weights and all.

A wrong map fails (b): with ``from_hf``'s key and value heads exchanged, the logits differ by far more than the
tolerance (docs/frameworks.md says by how much). Bad input is refused in one line, exit 2, nothing written.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from frameworks import accel, mcore
from helpers import run_cli_cases, run_command, user_env

from osdpipe.core.sizes import parse_size
from osdpipe.layout.megatron import Gpt
from osdpipe.layout.megatron_hf import from_hf, tied_names

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]

#: The tests' Llama: GQA, untied, a vocabulary Megatron pads (50 -> 256 at TP2), layers PP2 splits.
LLAMA = {"vocab_size": 50, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
#: The tests' GPT-2: 4 heads, 4 layers, the Llama's width and vocabulary, tied (transformers' default).
GPT2 = {"vocab_size": 50, "n_embd": 32, "n_inner": 48, "n_layer": 4, "n_head": 4, "n_positions": 32}
#: The GPT Megatron builds of the Llama at TP2 (vocabulary padded to 128 x 2).
GPT = Gpt(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2, kv_channels=8,
          padded_vocab_size=256, swiglu=True)
RELATIVE_TOLERANCE = 1e-4


def convert(work: Path, source: Path, out: Path, *overrides: str):
    return run_command(
        [sys.executable, "-m", "osdpipe", "checkpoint=accelerate", f"input.path={source}", "output.checkpoint=megatron",
         *overrides, f"output.path={out}"],
        cwd=work, timeout=300, env=user_env(),
    )


#: The Trainer's runs the module converts: the tests' Llama untied, tied (its ``lm_head`` the embedding, as Llama
#: 3.2's 1B and 3B), a Qwen2 of its dimensions, a Qwen3 of them with heads of 12 (not hidden / heads, as a Qwen3's
#: head dimension is its own), and the tests' GPT-2.
RUNS = {"untied": {"tied": False}, "tied": {"tied": True}, "qwen2": {"family": "qwen2"},
        "qwen3": {"family": "qwen3", "llama": {**LLAMA, "head_dim": 12}}, "gpt2": {"gpt2": GPT2}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """By :data:`RUNS`' name: the Trainer's checkpoint-3, its conversion to TP2 PP2 DP1, and what megatron-core made of
    it (loaded at that grid, its logits, a step on). The conversions run in one process (:func:`run_cli_cases`: the
    command's entry point), the loads in one megatron-core launch (:func:`mcore.each`): a launch's start is most of a
    load's time."""
    root = tmp_path_factory.mktemp("hf_to_megatron")
    cases, jobs, found = [], [], {}
    for name, variant in RUNS.items():
        work = root / name
        accel.trainer(work, 2, {"version": 2, "state_dict_type": None, "resume": None, "llama": LLAMA, **variant,
                                "out": str(work / "run"), "max_steps": 6}, label="train")
        source, out = work / "run" / "checkpoint-3", work / "megatron"
        found[name] = {"work": work, "source": source, "out": out}
        cases.append(["checkpoint=accelerate", f"input.path={source}", "output.checkpoint=megatron", "target.tp_size=2",
                      "target.pp_size=2", "target.world_size=4", f"output.path={out}"])
        jobs.append(mcore.load_argv(out, work / "loaded.pt", tp=2, pp=2, dims_from_save=True, no_load_rng=True,
                                    logits=work / "logits.pt", resume=1, dump_after=work / "after.pt"))
    # the untied Llama's checkpoint once more, for PP2 with 2 model chunks per stage (virtual stages), DP2
    virtual = root / "untied" / "virtual"
    virtual.mkdir()
    found["virtual"] = {"work": virtual, "source": found["untied"]["source"], "out": virtual / "megatron"}
    cases.append(["checkpoint=accelerate", f"input.path={found['untied']['source']}", "output.checkpoint=megatron",
                  "target.pp_size=2", "target.vpp_size=2", "target.world_size=4",
                  f"output.path={virtual / 'megatron'}"])
    jobs.append(mcore.load_argv(virtual / "megatron", virtual / "loaded.pt", tp=1, pp=2, vpp=2, dims_from_save=True,
                                no_load_rng=True, resume=1, dump_after=virtual / "after.pt"))
    for name, done in zip(found, run_cli_cases(cases, cwd=root, per_case_s=300, env=user_env()), strict=True):
        assert done["code"] == 0, f"{name}: {done['stderr'][-3000:]}"
        found[name]["stderr"] = done["stderr"]
    mcore.each(root, 4, jobs, label="load-tp2pp2")
    for case in found.values():
        logits = case["work"] / "logits.pt"
        case.update(loaded=torch.load(case["work"] / "loaded.pt", weights_only=False),
                    after=torch.load(case["work"] / "after.pt", weights_only=False),
                    logits=torch.load(logits, weights_only=True) if logits.exists() else None)
    return found


@pytest.fixture
def run(runs: dict[str, dict]) -> dict:
    """The untied Llama's run."""
    return runs["untied"]


def _differences(run: dict, gpt: Gpt) -> list[str]:
    """Every master, moment and weight megatron-core loaded that is not the Trainer's, mapped by ``from_hf``, bitwise
    (a tied model's weights file holds ``lm_head.weight`` too: the embedding's tensor again, which it must equal)."""
    optimizer = torch.load(run["source"] / "optimizer.bin", weights_only=True)
    weights = torch.load(run["source"] / "pytorch_model_fsdp.bin", weights_only=True)
    if (tied := tied_names(gpt)) is not None:
        embedding, output = tied
        assert torch.equal(weights.pop(output), weights[embedding])
    loaded = run["loaded"]
    want = {"param": from_hf(gpt, weights),
            **{s: from_hf(gpt, {k: v[s] for k, v in optimizer["state"].items()}) for s in ("exp_avg", "exp_avg_sq")}}
    differ = [f"{s} {k}" for s, tensors in want.items() for k, t in tensors.items()
              if not torch.equal(t, loaded["optim"][k][s])]
    return differ + [f"model {k}" for k, t in want["param"].items() if not torch.equal(t, loaded["model"][k])]


def test_megatron_holds_the_trainers_masters_moments_and_step_bitwise(run) -> None:
    loaded = run["loaded"]
    assert _differences(run, GPT) == []
    optimizer = torch.load(run["source"] / "optimizer.bin", weights_only=True)
    assert {float(state["step"]) for state in loaded["optim"].values()} == {3.0} and loaded["iteration"] == 3
    assert loaded["loaded"]["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    # Megatron's two groups, with the Trainer's hyperparameters: weight decay for the matrices, none for the norms
    groups = {g["wd_mult"]: g for g in loaded["param_groups"]}
    source = {g["weight_decay"]: g for g in optimizer["param_groups"]}
    assert groups[1.0]["weight_decay"] == source[0.1]["weight_decay"] and groups[0.0]["weight_decay"] == 0.0
    assert groups[1.0]["lr"] == source[0.1]["lr"] > 0
    assert set(groups[0.0]["params"]) == {k for k in loaded["model"] if k.endswith("norm_weight") or "layernorm" in k}


def test_a_tied_llamas_checkpoint_is_a_tied_megatron_gpt_that_computes_its_logits_and_trains_on(runs) -> None:
    """Llama 3.2's tied embedding, as the Trainer holds it (one parameter: ``optimizer.bin`` has no ``lm_head.weight``),
    is Megatron's tied embedding: no output layer of its own, the last stage's copy (PP2) equal to it, the same logits,
    and a step on."""
    run = runs["tied"]
    gpt = dataclasses.replace(GPT, tied=True)
    assert "lm_head.weight" not in torch.load(run["source"] / "optimizer.bin", weights_only=True)["state"]
    assert "output_layer.weight" not in run["loaded"]["optim"] and run["loaded"]["replicas_unequal"] == []
    assert _differences(run, gpt) == []
    diff, scale = mcore.hf_logits_gap(run["source"], run["logits"])
    print(f"tied: max |Megatron TP2 PP2 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale
    assert mcore.trained_on(run["loaded"], run["after"], step=3) == []


@pytest.mark.parametrize(("name", "change", "held", "keys"), [
    ("qwen2", {"qkv_bias": True}, ("q_proj.bias", "v_proj.bias"), ("linear_qkv.bias",)),
    ("qwen3", {"kv_channels": 12, "qk_layernorm": True}, ("q_norm.weight", "k_norm.weight"),
     ("q_layernorm.weight", "k_layernorm.weight")),
])
def test_a_qwens_checkpoint_is_a_megatron_gpt_with_its_tensors_that_computes_its_logits_and_trains_on(
    runs, name: str, change: dict, held: tuple[str, ...], keys: tuple[str, ...]
) -> None:
    """Qwen2's biases on q, k and v are Megatron's ``linear_qkv`` bias (cut per query group as its weight's rows);
    Qwen3's norms on each head's query and key are its ``q_layernorm`` and ``k_layernorm`` (``qk_layernorm``,
    ``kv_channels`` 12). Each with the Trainer's Adam state: the same tensors bitwise, the same logits, a step on;
    those tensors in the no-decay group, as the Trainer keeps them."""
    run = runs[name]
    gpt = dataclasses.replace(GPT, **change)
    config = json.loads((run["source"] / "config.json").read_text())
    assert config["architectures"] == [f"{name.capitalize()}ForCausalLM"]
    state = torch.load(run["source"] / "optimizer.bin", weights_only=True)["state"]
    assert {f"model.layers.0.self_attn.{n}" for n in held} <= set(state)
    theirs = [k for k in run["loaded"]["optim"] if k.endswith(keys)]
    assert len(theirs) == len(keys) and _differences(run, gpt) == []
    groups = {g["wd_mult"]: g for g in run["loaded"]["param_groups"]}
    assert set(theirs) <= set(groups[0.0]["params"])
    diff, scale = mcore.hf_logits_gap(run["source"], run["logits"])
    print(f"{name}: max |Megatron TP2 PP2 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale
    assert mcore.trained_on(run["loaded"], run["after"], step=3) == []


def test_a_gpt2s_checkpoint_is_megatron_lms_default_gpt_that_computes_its_logits_and_trains_on(runs) -> None:
    """GPT-2, as the Trainer holds it (Conv1D's ``[in, out]`` weights, ``c_attn`` fusing all queries, then all keys,
    then all values; one tied parameter for ``wte`` and ``lm_head``), is Megatron-LM's default GPT: LayerNorm, the
    learned position table, the tanh GeLU, a bias on every linear, tied; the same tensors bitwise, the same logits, a
    step on; every bias and norm in the no-decay group, as the Trainer keeps them."""
    run = runs["gpt2"]
    gpt = Gpt(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=4,
              kv_channels=8, padded_vocab_size=256, swiglu=False, linear_bias=True, norm_bias=True, position_table=32,
              tied=True)
    assert json.loads((run["source"] / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    held = torch.load(run["source"] / "optimizer.bin", weights_only=True)["state"]
    assert "transformer.wpe.weight" in held and "lm_head.weight" not in held
    assert "output_layer.weight" not in run["loaded"]["optim"] and run["loaded"]["replicas_unequal"] == []
    assert _differences(run, gpt) == []
    groups = {g["wd_mult"]: g for g in run["loaded"]["param_groups"]}
    assert set(groups[0.0]["params"]) == {k for k, t in run["loaded"]["model"].items()
                                          if k.endswith(("bias", "layer_norm_weight", "final_layernorm.weight"))}
    diff, scale = mcore.hf_logits_gap(run["source"], run["logits"])
    print(f"gpt2: max |Megatron TP2 PP2 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale
    assert mcore.trained_on(run["loaded"], run["after"], step=3) == []


def test_virtual_pipeline_stages_hold_the_trainers_state_and_train_on(runs) -> None:
    """``target.vpp_size=2``: megatron-core builds PP2 with 2 model chunks per stage (its interleaved schedule's, one
    layer each), loads the save, holds the Trainer's masters, moments, weights and step bitwise and takes a step."""
    run = runs["virtual"]
    assert run["loaded"]["layout"] == {"tp": 1, "pp": 2, "dp": 2, "vpp": 2}
    assert _differences(run, dataclasses.replace(GPT, padded_vocab_size=128)) == []  # the vocabulary padded at TP1
    assert {float(state["step"]) for state in run["loaded"]["optim"].values()} == {3.0}
    assert mcore.trained_on(run["loaded"], run["after"], step=3) == []


def test_megatrons_logits_are_the_trainers_models(run) -> None:
    assert run["logits"]["logits"].shape == (2, mcore.SEQ, GPT.padded_vocab_size)
    diff, scale = mcore.hf_logits_gap(run["source"], run["logits"])
    print(f"max |Megatron TP2 PP2 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale


def test_megatron_trains_on_from_the_converted_save(run) -> None:
    assert mcore.trained_on(run["loaded"], run["after"], step=3) == []


def test_the_report_says_what_became_of_each_entry(run) -> None:
    report = json.loads((run["out"] / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and list(checks) == ["roundtrip", "resume"] and all(c["ok"] for c in checks.values())
    assert "every element equals the source bitwise" in checks["roundtrip"]["detail"]
    fates = {e["name"]: e["fate"] for e in report["entries"]}
    assert fates["optimizer.bin"].startswith("converted") and fates["rng_state_0.pth"].startswith("left out")
    assert not any("load_state" in w for w in report["warnings"])  # accelerate's advice is not the output's
    assert sorted(p.name for p in run["out"].iterdir()) == [
        "iter_0000003", "latest_checkpointed_iteration.txt", "manifest.json", "osdpipe.log", "report.json"]


def _edited(work: Path, source: Path, name: str, **config) -> Path:
    copy = work / name
    shutil.copytree(source, copy)
    held = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**held, **config}))
    return copy


@pytest.mark.parametrize("case", ["mistral", "attention_bias", "no_config", "tp3", "pp3", "vpp3"])
def test_bad_input_is_one_line_exit_2_nothing_written(run, case) -> None:
    work, source = run["work"], run["source"]
    grid = ["target.tp_size=2", "target.world_size=2"]
    if case == "mistral":
        given = _edited(work, source, case, model_type="mistral", architectures=["MistralForCausalLM"])
    elif case == "attention_bias":
        given = _edited(work, source, case, attention_bias=True)
    elif case == "no_config":
        given = work / case
        shutil.copytree(source, given)
        (given / "config.json").unlink()
    else:
        given, grid = source, {"tp3": ["target.tp_size=3", "target.world_size=3"],
                               "pp3": ["target.pp_size=3", "target.world_size=3"],
                               "vpp3": ["target.pp_size=2", "target.vpp_size=3", "target.world_size=2"]}[case]
    out = work / f"out-{case}"
    done = convert(work, given, out, *grid)
    said = {"mistral": "not a LlamaForCausalLM", "attention_bias": "attention biases", "no_config": "config.json",
            "tp3": "does not divide the model's 4 attention heads", "pp3": "does not divide the model's 4 layers",
            "vpp3": "target.pp_size=2 x target.vpp_size=3 does not divide the model's 4 layers"}
    assert done.returncode == 2 and said[case] in done.stderr, done.stderr[-2000:]
    assert len([line for line in done.stderr.splitlines() if "error" in line]) == 1
    assert not out.exists()


def test_check_proves_the_save_against_its_source_and_fails_against_another(run) -> None:
    """``osdpipe check``: the source read again and mapped, against the save read back, bitwise; the Trainer's later
    ``checkpoint-6`` (another step's state) is not what the save holds."""
    args = [sys.executable, "-m", "osdpipe", "check", str(run["out"])]
    done = run_command(args, cwd=run["work"], timeout=300, env=user_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check roundtrip  pass" in done.stdout
    other = run_command([*args, f"input.path={run['source'].parent / 'checkpoint-6'}"], cwd=run["work"], timeout=300,
                        env=user_env())
    assert other.returncode == 1 and "check roundtrip  FAIL" in other.stdout, other.stdout + other.stderr


def test_a_memory_budget_bounds_the_conversion_and_writes_the_same_bytes(run) -> None:
    """Through the stage loop, the map's conversion reads by ranges inside ``runtime.memory_budget``: the report
    records the budget, and the save's files are those of the run without one, byte for byte."""
    out = run["work"] / "budgeted"
    done = convert(run["work"], run["source"], out, "target.tp_size=2", "target.pp_size=2", "target.world_size=4",
                   "runtime.memory_budget=64MB")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["memory_budget"] == parse_size("64MB")

    def digests(folder: Path) -> dict[str, str]:
        return json.loads((folder / "manifest.json").read_text())["files"]

    assert digests(out) == digests(run["out"])
