"""A Hugging Face model folder -> a Megatron-LM release save of its weights, at TP2 PP2 (issue 40, ``checkpoint=hf``).

transformers 5.23.0 builds the test's own ``LlamaForCausalLM`` (GQA: 6 heads in 2 key/value heads, hidden 48, untied,
vocabulary 61, which Megatron pads to 256 at TP2; 4 layers), seeded, and ``save_pretrained`` writes it in safetensors
shards with an index, as large models are published. The ``osdpipe`` command converts the folder
(``checkpoint=hf output.checkpoint=megatron``), the dimensions from its ``config.json``. The real megatron-core 0.16.1
job (:mod:`frameworks.mcore`, built with the save's own dimensions, loading as Megatron-LM's ``load_checkpoint`` loads
a ``release`` save: the model alone, iteration 0, no flags) loads it on 4 ranks at TP2 PP2 and:

(a) holds, gathered, the folder's weights mapped by ``from_hf`` bitwise, the padding rows zero;
(b) computes, through its pipeline schedule, the logits transformers' own forward of the folder computes, within
    ``max |diff| <= 1e-4 x max |logit|`` (fp32; the tolerance of ``test_megatron_hf.py``, which says why);
(c) trains on from a fresh optimizer and schedule: two steps (synthetic gradients; the first at the warmup's learning
    rate 0) to step 2, iteration 2, every weight moved.

A bf16 folder converts to a bf16 Megatron job's weights, bit for bit (TP2 PP1), and the job's fp32 masters start from
them (Megatron-LM's ``reload_model_params``): its second step moves no weight by more than a step's size. ``osdpipe
check`` proves the save against its folder and fails against another model's. transformers' Qwen2 (Megatron's
``--add-qkv-bias``) and a Llama with every linear biased (``--add-bias-linear``) convert too: megatron-core holds their
tensors bitwise and computes their logits; so does a Llama with tied embeddings (``tie_word_embeddings``) and a GPT-2
(Megatron-LM's default GPT), whose saves convert back to the same folders, and a Qwen3 (a norm on each head's query
and key, a head dimension other than hidden / heads: Megatron's ``--qk-layernorm``, ``--kv-channels``). A Llama of 8
heads in 2 key/value heads converts at TP4, megatron-core's rule (each key/value head on 2 ranks): megatron-core holds
its tensors bitwise and computes its logits.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from frameworks import mcore
from helpers import run_cli_cases, run_command, user_env
from megatron_oracle import read_save

from osdpipe.io.checkpoints.megatron_foreign import FRESH as FRESH_OPTIMIZER
from osdpipe.io.formats.megatron import gpt_of
from osdpipe.io.hf_folder import read_weights
from osdpipe.layout.megatron import Gpt
from osdpipe.layout.megatron_hf import from_hf

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]

#: The test's Llama: GQA, untied, a vocabulary Megatron pads (61 -> 256 at TP2), layers PP2 splits.
LLAMA = {"vocab_size": 61, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 32,
         "tie_word_embeddings": False}
#: The GPT Megatron builds of it at TP2 (vocabulary padded to 128 x 2).
GPT = Gpt(num_layers=4, hidden_size=48, ffn_hidden_size=64, num_attention_heads=6, num_query_groups=2, kv_channels=8,
          padded_vocab_size=256, swiglu=True)
RELATIVE_TOLERANCE = 1e-4


def save_llama(folder: Path, seed: int, dtype: torch.dtype = torch.float32) -> Path:
    """transformers' own Llama of :data:`LLAMA`, seeded, saved by ``save_pretrained`` in shards with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(dtype)
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder




def save_biased(folder: Path, family: str) -> Path:
    """transformers' own Qwen2 (q, k and v biased: Megatron's ``add_qkv_bias``) or Llama with every linear biased
    (``add_bias_linear``), biases drawn at 0.1 so that they move the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**LLAMA))
    else:
        model = LlamaForCausalLM(LlamaConfig(**LLAMA, attention_bias=True, mlp_bias=True))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return folder


def save_tied(folder: Path, family: str) -> Path:
    """transformers' Llama with ``tie_word_embeddings``, or its GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=32, n_embd=48, n_layer=4, n_head=6, n_inner=64,
                                           bos_token_id=None, eos_token_id=None))
        with torch.no_grad():  # transformers starts biases and LayerNorm's at 0 and 1: drawn, so that a map that
            for name, parameter in model.named_parameters():  # lost or swapped one would move the logits
                if name.endswith(".bias") or ".ln_" in name:
                    parameter.normal_(1.0 if name.endswith(".weight") else 0.0, 0.1)
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "tie_word_embeddings": True}))
    model.save_pretrained(folder)
    return folder


def save_gqa_for_tp4(folder: Path) -> Path:
    """transformers' own Llama of :data:`LLAMA` with 8 heads (of 6) in its 2 key/value heads: a TP of 4 splits the
    heads, and holds each key/value head on 2 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(17)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_attention_heads": 8})).save_pretrained(folder)
    return folder


def save_qwen3(folder: Path) -> Path:
    """transformers' own Qwen3: :data:`LLAMA`'s dimensions with heads of 12 (6 x 12 = 72, not the hidden 48, as a
    Qwen3's head dimension is its own), its head norms drawn about 1 so that a map that lost or swapped them would
    move the logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(13)
    model = Qwen3ForCausalLM(Qwen3Config(**LLAMA, head_dim=12))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    return folder


#: Each folder the module converts: how it is saved, the grid (TP, PP) it converts to, and how megatron-core loads it
#: (``resume``: that many steps on, then a second dump; each but the bf16 one with its logits on the probe tokens).
FOLDERS = {
    "llama": (lambda f: save_llama(f, seed=7), (2, 2), {"resume": 2}),
    "bf16": (lambda f: save_llama(f, seed=11, dtype=torch.bfloat16), (2, 1),
             {"bf16": True, "resume": 2, "logits": None}),
    "qwen2": (lambda f: save_biased(f, "qwen2"), (2, 1), {}),
    "llama with attention_bias and mlp_bias": (lambda f: save_biased(f, "llama"), (2, 1), {}),
    "llama with tie_word_embeddings": (lambda f: save_tied(f, "llama"), (2, 2), {}),
    "gpt2": (lambda f: save_tied(f, "gpt2"), (2, 2), {}),
    "qwen3": (save_qwen3, (2, 2), {}),
    "llama at TP4 over 2 key/value heads": (save_gqa_for_tp4, (4, 1), {}),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, dict]:
    """Each folder of :data:`FOLDERS` saved by transformers, converted by the ``osdpipe`` command to a Megatron save at
    its grid, and loaded there by megatron-core built from the save's own ``args``: by name, its ``work`` folder, the
    ``source``, the ``out``put, the command's ``stderr``, the ``loaded`` dump, its ``logits`` and (where resumed) the
    dump ``after``.

    The conversions run in one process (:func:`run_cli_cases`: the command's entry point, as the script calls it), the
    loads in one megatron-core launch per world size (:func:`mcore.each`): a launch's start, most of a load's time, is
    paid twice rather than six times."""
    root = tmp_path_factory.mktemp("hf_folder_to_megatron")
    cases, jobs, found = [], {}, {}
    for i, (name, (save, (tp, pp), load)) in enumerate(FOLDERS.items()):
        work = root / f"case{i}"
        work.mkdir()
        source, out = save(work / "folder"), work / "megatron"
        found[name] = {"work": work, "source": source, "out": out}
        cases.append(["checkpoint=hf", f"input.path={source}", "output.checkpoint=megatron", f"target.tp_size={tp}",
                      f"target.pp_size={pp}", f"target.world_size={tp * pp}", f"output.path={out}"])
        options = {"logits": work / "logits.pt", **load}
        if options.get("resume"):
            options["dump_after"] = work / "after.pt"
        jobs.setdefault(tp * pp, []).append(mcore.load_argv(out, work / "loaded.pt", tp=tp, pp=pp, dims_from_save=True,
                                                            **options))
    for name, done in zip(FOLDERS, run_cli_cases(cases, cwd=root, per_case_s=300, env=user_env()), strict=True):
        assert done["code"] == 0, f"{name}: {done['stderr'][-3000:]}"
        found[name]["stderr"] = done["stderr"]
    for world, each in sorted(jobs.items()):
        mcore.each(root, world, each, label=f"load-release-{world}")
    for name, case in found.items():
        case["loaded"] = torch.load(case["work"] / "loaded.pt", weights_only=False)
        if FOLDERS[name][2].get("logits", True):
            case["logits"] = torch.load(case["work"] / "logits.pt", weights_only=True)
        if FOLDERS[name][2].get("resume"):
            case["after"] = torch.load(case["work"] / "after.pt", weights_only=False)
    return found


@pytest.fixture
def run(made: dict[str, dict]) -> dict:
    """The untied Llama's folder, its conversion to TP2 PP2 DP1, and what megatron-core made of it."""
    return made["llama"]


def test_the_folder_is_sharded_as_published_models_are(run) -> None:
    names = {p.name for p in run["source"].iterdir()}
    assert "model.safetensors.index.json" in names and len([n for n in names if n.endswith(".safetensors")]) > 1


def test_megatron_holds_the_folders_weights_bitwise_at_iteration_0(run) -> None:
    loaded = run["loaded"]
    want = from_hf(GPT, read_weights(run["source"]), GPT.padded_vocab_size)
    assert sorted(loaded["model"]) == sorted(want)
    assert [k for k, t in want.items() if not torch.equal(t, loaded["model"][k])] == []
    assert loaded["iteration"] == 0 and loaded["optim"] == {}  # the optimizer holds no state until it steps
    info = loaded["loaded"]
    assert info["release"] and not info["optimizer_loaded"] and not info["rng_loaded"]


def test_megatrons_logits_are_the_folders_models(run) -> None:
    assert run["logits"]["logits"].shape == (2, mcore.SEQ, GPT.padded_vocab_size)
    diff, scale = mcore.hf_logits_gap(run["source"], run["logits"])
    print(f"max |Megatron TP2 PP2 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale


def test_megatron_trains_on_from_a_fresh_optimizer(run) -> None:
    loaded, after = run["loaded"], run["after"]
    steps = sorted({float(s["step"]) for s in after["optim"].values()})
    assert after["iteration"] == 2 and steps == [2.0]
    assert [k for k in loaded["model"] if torch.equal(loaded["model"][k], after["model"][k])] == []
    assert all(bool(torch.isfinite(s["exp_avg"]).all()) for s in after["optim"].values())


def test_the_report_says_the_optimizer_starts_fresh(run) -> None:
    report = json.loads((run["out"] / "report.json").read_text())
    assert report["ok"] and FRESH_OPTIMIZER in report["warnings"] and FRESH_OPTIMIZER in run["stderr"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["roundtrip"]["ok"] and "every element equals the source bitwise" in checks["roundtrip"]["detail"]
    assert checks["resume"]["ok"], checks["resume"]
    fates = {e["name"]: e["fate"] for e in report["entries"]}
    assert fates["config.json"].startswith("converted") and fates["generation_config.json"].startswith("kept")
    assert all(f.startswith("converted") for n, f in fates.items() if n.endswith(".safetensors"))
    assert sorted(p.name for p in run["out"].iterdir()) == [
        "latest_checkpointed_iteration.txt", "manifest.json", "osdpipe.log", "release", "report.json"]
    assert (run["out"] / "latest_checkpointed_iteration.txt").read_text() == "release"


def test_check_proves_the_save_against_its_folder_and_fails_against_another(run) -> None:
    args = [sys.executable, "-m", "osdpipe", "check", str(run["out"])]
    done = run_command(args, cwd=run["work"], timeout=300, env=user_env())
    assert done.returncode == 0 and "check roundtrip  pass" in done.stdout, done.stdout + done.stderr
    other = save_llama(run["work"] / "other", seed=8)
    differs = run_command([*args, f"input.path={other}"], cwd=run["work"], timeout=300, env=user_env())
    assert differs.returncode == 1 and "check roundtrip  FAIL" in differs.stdout, differs.stdout + differs.stderr


def test_a_bf16_folder_is_a_bf16_jobs_weights_bitwise(made: dict[str, dict]) -> None:
    source, loaded, after = (made["bf16"][k] for k in ("source", "loaded", "after"))
    want = from_hf(GPT, read_weights(source), GPT.padded_vocab_size)
    assert {t.dtype for t in want.values()} == {torch.bfloat16}
    assert [k for k, t in want.items() if not torch.equal(t, loaded["model"][k])] == []
    # Adam's second step moves an element by about the learning rate (5e-4 here); masters left at the job's own
    # initialisation instead of the loaded weights would move them by the weights' scale (0.02)
    moved = {k: float((after["model"][k].float() - t.float()).abs().max()) for k, t in want.items()}
    assert max(moved.values()) <= 2e-3 and any(m > 0 for m in moved.values()), moved


def test_a_bf16_folder_comes_back_from_its_save_as_transformers_saved_it(made: dict[str, dict]) -> None:
    """The bf16 folder's save, converted back to a folder, is the folder transformers saved: its config.json's fields
    (the token ids among them, null before), its generation_config.json (missing before) and bf16 weights bitwise,
    which ``from_pretrained`` loads as bf16 (it loaded fp32)."""
    from transformers import AutoModelForCausalLM

    case = made["bf16"]
    back = _back_to_a_folder(case)
    theirs, ours = (json.loads((folder / "config.json").read_text()) for folder in (case["source"], back))
    assert theirs["bos_token_id"] is not None and theirs["eos_token_id"] is not None
    assert {k: ours.get(k) for k, v in theirs.items() if ours.get(k) != v} == {}
    assert (back / "generation_config.json").read_bytes() == (case["source"] / "generation_config.json").read_bytes()
    assert AutoModelForCausalLM.from_pretrained(back).dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["qwen2", "llama with attention_bias and mlp_bias"])
def test_a_biased_folder_is_a_megatron_save_that_computes_its_logits(made: dict[str, dict], family: str) -> None:
    """transformers' own Qwen2 or Llama with every linear biased (:func:`save_biased`) converts at TP2: megatron-core,
    built from the save's ``args``, holds the folder's tensors mapped by ``from_hf`` bitwise and computes its
    logits."""
    source, loaded = made[family]["source"], made[family]["loaded"]
    biased = Gpt(**{**GPT.__dict__, "linear_bias": family != "qwen2", "qkv_bias": family == "qwen2"})
    want = from_hf(biased, read_weights(source), biased.padded_vocab_size)
    assert sorted(loaded["model"]) == sorted(want) and any(k.endswith(".bias") for k in want)
    assert [k for k, t in want.items() if not torch.equal(t, loaded["model"][k])] == []
    diff, scale = mcore.hf_logits_gap(source, made[family]["logits"])
    print(f"{family}: max |Megatron TP2 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale


@pytest.mark.parametrize("family", ["llama with tie_word_embeddings", "gpt2"])
def test_a_tied_folder_is_a_tied_megatron_gpt_that_computes_its_logits_and_converts_back_to_the_same_folder(
    made: dict[str, dict], family: str
) -> None:
    """transformers' Llama with ``tie_word_embeddings`` (Llama 3.2's 1B and 3B, Qwen2.5's smaller models: no
    ``lm_head.weight`` in the folder), or its GPT-2 (LayerNorm, a learned position table, the tanh GeLU, every linear
    biased, tied: Megatron-LM's default GPT), converts at TP2 PP2 to a Megatron GPT with its embedding tied to the
    output layer: megatron-core, built from the save's ``args``, holds the folder's tensors bitwise (the last stage's
    copy of the embedding equal to the first stage's: the harness compares every replica with its main one) and
    computes its logits through the pipeline. Converted back to a folder, it is the folder's tensors bitwise, which
    transformers loads tied."""
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

    source, out, loaded = (made[family][k] for k in ("source", "out", "loaded"))
    assert "lm_head.weight" not in read_weights(source)
    gpt = gpt_of(read_save(out).args)
    assert gpt.tied and (gpt.norm_bias, bool(gpt.position_table)) == ((family == "gpt2"),) * 2
    want = from_hf(gpt, read_weights(source), gpt.padded_vocab_size)
    assert sorted(loaded["model"]) == sorted(want) and "output_layer.weight" not in want
    assert [k for k, t in want.items() if not torch.equal(t, loaded["model"][k])] == []
    assert loaded["replicas_unequal"] == []
    diff, scale = mcore.hf_logits_gap(source, made[family]["logits"])
    print(f"{family}: max |Megatron TP2 PP2 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale

    reloaded = AutoModelForCausalLM.from_pretrained(_back_to_a_folder(made[family]))
    assert type(reloaded) is (GPT2LMHeadModel if family == "gpt2" else LlamaForCausalLM)
    assert reloaded.config.tie_word_embeddings
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight


def test_a_qwen3_folder_is_a_megatron_gpt_with_head_norms_that_computes_its_logits_and_converts_back(
    made: dict[str, dict],
) -> None:
    """transformers' own Qwen3 (:func:`save_qwen3`) converts at TP2 PP2 to a Megatron GPT with ``qk_layernorm`` and
    ``kv_channels`` 12: megatron-core, built from the save's ``args``, holds the folder's tensors bitwise (the head
    norms whole on every TP rank) and computes its logits through the pipeline. Converted back to a folder, it is the
    folder's tensors bitwise, which transformers loads as a Qwen3."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    source, out, loaded = (made["qwen3"][k] for k in ("source", "out", "loaded"))
    gpt = gpt_of(read_save(out).args)
    assert gpt.qk_layernorm and gpt.kv_channels == 12 and not gpt.has_qkv_bias
    want = from_hf(gpt, read_weights(source), gpt.padded_vocab_size)
    assert sorted(loaded["model"]) == sorted(want) and "decoder.layers.self_attention.q_layernorm.weight" in want
    assert [k for k, t in want.items() if not torch.equal(t, loaded["model"][k])] == []
    assert loaded["replicas_unequal"] == []
    diff, scale = mcore.hf_logits_gap(source, made["qwen3"]["logits"])
    print(f"qwen3: max |Megatron TP2 PP2 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale
    model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    with torch.no_grad():  # the comparison sees the head norms: at transformers' initial ones, the logits move
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.fill_(1.0)
        probe = made["qwen3"]["logits"]
        moved = float((model(probe["tokens"]).logits - probe["logits"][..., :LLAMA["vocab_size"]]).abs().max())
    print(f"qwen3: head norms at 1 move the logits by {moved:.3g}")
    assert moved > 10 * RELATIVE_TOLERANCE * scale, moved

    assert type(AutoModelForCausalLM.from_pretrained(_back_to_a_folder(made["qwen3"]))) is Qwen3ForCausalLM


def _back_to_a_folder(case: dict) -> Path:
    """The case's Megatron save converted back to a Hugging Face folder by the ``osdpipe`` command, which must hold
    the source folder's tensors, every one bitwise."""
    back = case["work"] / "back"
    done = run_command([sys.executable, "-m", "osdpipe", "checkpoint=megatron", f"input.path={case['out']}",
                        "output.checkpoint=hf", f"output.path={back}"], cwd=case["work"], timeout=300, env=user_env())
    assert done.returncode == 0, done.stderr[-3000:]
    theirs, ours = read_weights(case["source"]), read_weights(back)
    assert sorted(ours) == sorted(theirs) and [k for k, t in theirs.items() if not torch.equal(t, ours[k])] == []
    return back


def test_a_tp_over_more_ranks_than_key_value_heads_is_one_megatron_core_loads(made: dict[str, dict]) -> None:
    """8 heads in 2 key/value heads converts at TP4, as megatron-core's ``TransformerConfig`` takes it (a TP that is a
    multiple of the key/value heads, each head then held by 2 ranks) and as a Megatron save converts to TP4
    (test_megatron.py); the folder was refused ("choose a TP that does: 1, 2"). megatron-core, built from the save's
    ``args`` at TP4, holds the folder's tensors bitwise, each key/value head's replicas equal, and computes its
    logits."""
    case = made["llama at TP4 over 2 key/value heads"]
    save = read_save(case["out"])
    gpt = gpt_of(save.args)
    assert (save.tp, gpt.num_attention_heads, gpt.num_query_groups, gpt.padded_vocab_size) == (4, 8, 2, 512)
    want = from_hf(gpt, read_weights(case["source"]), gpt.padded_vocab_size)
    loaded = case["loaded"]
    assert sorted(loaded["model"]) == sorted(want)
    assert [k for k, t in want.items() if not torch.equal(t, loaded["model"][k])] == []
    assert loaded["replicas_unequal"] == []
    diff, scale = mcore.hf_logits_gap(case["source"], case["logits"])
    print(f"TP4 over 2 key/value heads: max |Megatron TP4 - HF| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= RELATIVE_TOLERANCE * scale
