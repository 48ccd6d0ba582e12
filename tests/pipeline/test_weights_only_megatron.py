"""``checkpoint=hf``: a Hugging Face model folder -> a Megatron-LM release save of its weights, without Megatron or
transformers (the folder written by osdpipe's own safetensors writer; tests/frameworks/test_hf_folder_to_megatron.py
has the real packages save and load). What it proves: the command's save holds the weights alone, mapped bitwise; one
wrong element is seen; a weights-only save converts on (another grid, a Hugging Face folder); bad input is one line,
exit 2, nothing written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_command, user_env
from hf_llama_folder import CONFIG, write_llama
from megatron_oracle import read_save
from megatron_oracle_check import hf_source_problems

from osdpipe.io import hf_folder
from osdpipe.io.formats.megatron import gpt_of
from osdpipe.layout import megatron_hf


def osdpipe(cwd: Path, *args: str):
    return run_command([sys.executable, "-m", "osdpipe", *args], cwd=cwd, timeout=120, env=user_env())


def test_the_save_holds_the_weights_alone_mapped_bitwise(tmp_path: Path) -> None:
    state = write_llama(tmp_path / "hf")
    done = osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.pp_size=2",
                   "target.world_size=8", "output.path=out")
    assert done.returncode == 0, done.stderr
    save = read_save(tmp_path / "out")
    assert save.weights_only and save.release and save.iteration == 0 and save.optim == {} and save.scheduler is None
    assert save.folder.name == "release" and (save.tp, save.pp, save.dp) == (2, 2, 2)
    assert save.args["no_save_optim"] and save.args["no_save_rng"] and not save.args["bf16"]
    want = megatron_hf.from_hf(gpt_of(save.args), state, int(save.args["padded_vocab_size"]))
    assert [k for k, t in want.items() if not torch.equal(t, save.model[k])] == []
    assert save.model["embedding.word_embeddings.weight"].shape[0] == 256


def test_one_wrong_element_is_seen(tmp_path: Path) -> None:
    state = write_llama(tmp_path / "hf")
    assert osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.world_size=2",
                   "output.path=out").returncode == 0
    save = read_save(tmp_path / "out")
    gpt = gpt_of(save.args)
    assert hf_source_problems(gpt, 50, {"weights": state}.get, 0.0, [], save) == []
    wrong = {k: t.clone() for k, t in state.items()}
    wrong["model.layers.1.self_attn.k_proj.weight"][3, 5] += 1e-3
    assert hf_source_problems(gpt, 50, {"weights": wrong}.get, 0.0, [], save) == [
        "model weights model.layers.1.self_attn.k_proj.weight: differs from the Hugging Face source's"]


def test_a_bf16_folder_keeps_its_dtype(tmp_path: Path) -> None:
    state = write_llama(tmp_path / "hf", dtype=torch.bfloat16)
    assert osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.world_size=2",
                   "output.path=out").returncode == 0
    save = read_save(tmp_path / "out")
    assert save.args["bf16"] and {t.dtype for t in save.model.values()} == {torch.bfloat16}
    want = megatron_hf.from_hf(gpt_of(save.args), state, 256)
    assert all(torch.equal(t, save.model[k]) for k, t in want.items())


def test_a_weights_only_save_converts_to_another_grid_and_to_a_hugging_face_folder(tmp_path: Path) -> None:
    state = write_llama(tmp_path / "hf")
    assert osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.world_size=2",
                   "output.path=tp2").returncode == 0
    regrid = osdpipe(tmp_path, "checkpoint=megatron", "input.path=tp2", "target.tp_size=1", "target.pp_size=2",
                     "target.world_size=2", "output.path=pp2")
    assert regrid.returncode == 0, regrid.stderr
    save = read_save(tmp_path / "pp2")
    assert save.weights_only and save.release and (save.tp, save.pp) == (1, 2)
    warnings = json.loads((tmp_path / "pp2" / "report.json").read_text())["warnings"]
    assert any("holds the model alone (no optimizer state)" in w for w in warnings), warnings
    back = osdpipe(tmp_path, "checkpoint=megatron", "input.path=pp2", "output.checkpoint=hf", "output.path=hf2")
    assert back.returncode == 0, back.stderr
    assert all(torch.equal(t, hf_folder.read_weights(tmp_path / "hf2")[k]) for k, t in state.items())
    refused = osdpipe(tmp_path, "checkpoint=megatron", "input.path=pp2", "target.tp_size=2", "target.world_size=2",
                      "output.megatron_optim_format=fully_reshardable", "output.path=optim")
    assert refused.returncode == 2 and "no optimizer state" in refused.stderr and not (tmp_path / "optim").exists()


@pytest.mark.parametrize("case", ["no_config", "bin_only", "mistral", "tp3", "optim_format", "pytorch_out",
                                  "own_model"])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path: Path, case: str) -> None:
    source = tmp_path / "hf"
    write_llama(source)
    if case == "mistral":
        (source / "config.json").write_text(json.dumps({**CONFIG, "model_type": "mistral"}))
    if case == "no_config":
        (source / "config.json").unlink()
    if case == "bin_only":
        for p in source.glob("model*"):
            p.unlink()
        (source / "pytorch_model.bin").write_bytes(b"")
    extra = {"tp3": ["target.tp_size=3", "target.world_size=3"],
             "optim_format": ["output.megatron_optim_format=dp_reshardable"],
             "pytorch_out": ["output.checkpoint=pytorch"],
             "own_model": ["model.factory=hf_llama"]}.get(case, [])
    done = osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.world_size=2", *extra,
                   "output.path=out")
    said = {"no_config": "config.json", "bin_only": "save_pretrained(safe_serialization=True)",
            "mistral": "not a LlamaForCausalLM", "tp3": "does not divide the model's 4 attention heads",
            "optim_format": "holds no optimizer state", "pytorch_out": "set output.checkpoint=megatron",
            "own_model": "model.factory=hf_llama: a megatron output holds megatron's own model"}
    assert done.returncode == 2 and said[case] in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_inspect_names_the_folder_and_the_command(tmp_path: Path) -> None:
    write_llama(tmp_path / "hf")
    done = osdpipe(tmp_path, "inspect", "hf")
    assert done.returncode == 0, done.stderr
    assert "layout       hf" in done.stdout and "4 heads in 2 key/value heads" in done.stdout
    assert "convert with osdpipe checkpoint=hf input.path=hf target.tp_size=T" in done.stdout
    # a training run's folder with the same files (the HF Trainer's checkpoint-<N>) is not read as a model folder
    (tmp_path / "hf" / "trainer_state.json").write_text("{}")
    assert "layout       hf" not in osdpipe(tmp_path, "inspect", "hf").stdout


def test_inspect_says_a_release_save_is_weights_only_and_how_to_convert_it(tmp_path: Path) -> None:
    """inspect said of a release save "no distributed optimizer state (a non-distributed optimizer): not supported
    yet", then "fp32 master weights and moments". It says weights only, iteration 0, a fresh optimizer on load, and
    prints a command that converts it (run here with its placeholders filled)."""
    write_llama(tmp_path / "hf", dtype=torch.bfloat16)
    assert osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.world_size=2",
                   "output.path=out").returncode == 0
    shown = run_command([sys.executable, "-m", "osdpipe", "inspect", "out"], cwd=tmp_path, timeout=120,
                        env=user_env())  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    said = shown.stdout
    for wrong in ("not supported yet", "master weights", "moments", "non-distributed optimizer", "the optimizer incl"):
        assert wrong not in said, said
    assert "release save (iteration 0)" in said, said
    assert "weights only (bfloat16): no optimizer state (args.no_save_optim); a job that loads it starts a fresh " \
           "optimizer, scheduler and RNG" in said, said
    [command] = [line.split("convert with ", 1)[1] for line in said.splitlines() if "convert with " in line]
    args = command.split()
    assert args[:3] == ["osdpipe", "checkpoint=megatron", "input.path=out/release"], command
    filled = {"target.tp_size=T": "target.tp_size=1", "target.pp_size=P": "target.pp_size=1",
              "target.world_size=M": "target.world_size=1", "output.path=OUT_DIR": "output.path=tp1"}
    converted = osdpipe(tmp_path, *(filled.get(a, a) for a in args[1:]))
    assert converted.returncode == 0, converted.stderr
    assert read_save(tmp_path / "tp1").weights_only


#: What a bf16 folder says of itself beyond its dimensions: its token ids and the fields transformers writes.
OWN_FIELDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "dtype": "bfloat16",
              "transformers_version": "5.23.0", "initializer_range": 0.02, "use_cache": True}
GENERATION = '{\n  "bos_token_id": 1,\n  "do_sample": true,\n  "eos_token_id": 2,\n  "temperature": 0.6\n}\n'


def test_a_folder_made_into_a_megatron_save_comes_back_the_same_folder(tmp_path: Path) -> None:
    """Megatron's args hold the model's dimensions alone: a bf16 folder came back with null token ids, no
    generation_config.json and fp32 weights. The save keeps the folder's config.json and generation_config.json
    (common.pt), another grid carries them, and the folder made of it is the same: every field of config.json,
    generation_config.json byte for byte, the bf16 weights bitwise."""
    state = write_llama(tmp_path / "hf", dtype=torch.bfloat16)
    config = {**json.loads((tmp_path / "hf" / "config.json").read_text()), **OWN_FIELDS}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config, indent=2))
    (tmp_path / "hf" / "generation_config.json").write_text(GENERATION)
    made = osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.world_size=2",
                   "output.path=tp2")
    assert made.returncode == 0, made.stderr
    fates = {e["name"]: e["fate"] for e in json.loads((tmp_path / "tp2" / "report.json").read_text())["entries"]}
    assert fates["generation_config.json"].startswith("kept") and "kept whole" in fates["config.json"]
    regrid = osdpipe(tmp_path, "checkpoint=megatron", "input.path=tp2", "target.tp_size=1", "target.pp_size=2",
                     "target.world_size=2", "output.path=pp2")
    assert regrid.returncode == 0, regrid.stderr
    back = osdpipe(tmp_path, "checkpoint=megatron", "input.path=pp2", "output.checkpoint=hf", "output.path=hf2")
    assert back.returncode == 0, back.stderr
    again = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert {k: again.get(k, "(none)") for k, v in config.items() if again.get(k, "(none)") != v} == {}
    assert again["torch_dtype"] == "bfloat16"
    assert (tmp_path / "hf2" / "generation_config.json").read_text() == GENERATION
    weights = hf_folder.read_weights(tmp_path / "hf2")
    assert sorted(weights) == sorted(state) and {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert [k for k, t in state.items() if not torch.equal(t, weights[k])] == []
    report = json.loads((tmp_path / "hf2" / "report.json").read_text())
    assert not [w for w in report["warnings"] if "bos_token_id" in w], report["warnings"]
    assert report["checks"] and all(c["ok"] for c in report["checks"]), report["checks"]
    checked = osdpipe(tmp_path, "check", "hf2")
    assert checked.returncode == 0 and "check roundtrip  pass" in checked.stdout, checked.stdout + checked.stderr
    (tmp_path / "hf2" / "generation_config.json").write_text(GENERATION.replace("0.6", "0.7"))
    changed = osdpipe(tmp_path, "check", "hf2")
    assert changed.returncode == 1 and "generation_config.json" in changed.stdout, changed.stdout


def test_a_megatron_jobs_save_becomes_a_folder_in_its_params_dtype_naming_what_it_cannot_know(tmp_path: Path) -> None:
    """A save of Megatron training: the folder's weights are in the job's params dtype (a bf16 job's: bf16, its fp32
    masters rounded as Megatron rounds its model's), fp32 where ``output.dtype`` says so; the token ids and a
    generation_config.json are not in the save, and the report says so."""
    from synthetic_megatron import synthetic_save

    save = synthetic_save(tmp_path, 1, bf16=True)
    masters = {k: s["param"] for k, s in read_save(save).optim.items()}
    for dtype, out in (("bfloat16", "hf_bf16"), ("float32", "hf_fp32")):
        extra = ["output.dtype=float32"] if dtype == "float32" else []
        done = osdpipe(tmp_path, "checkpoint=megatron", f"input.path={save}", "output.checkpoint=hf", *extra,
                       f"output.path={out}")
        assert done.returncode == 0, done.stderr
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert (config["dtype"], config["bos_token_id"], config["eos_token_id"]) == (dtype, None, None)
        weights = hf_folder.read_weights(tmp_path / out)
        assert {t.dtype for t in weights.values()} == {getattr(torch, dtype)}
        gpt = gpt_of(read_save(save).args)
        back = megatron_hf.from_hf(gpt, weights, gpt.padded_vocab_size)
        assert torch.equal(back["decoder.final_layernorm.weight"], masters["decoder.final_layernorm.weight"].to(
            getattr(torch, dtype)))
        assert not (tmp_path / out / "generation_config.json").exists()
        warnings = json.loads((tmp_path / out / "report.json").read_text())["warnings"]
        [said] = [w for w in warnings if "bos_token_id" in w]
        assert "eos_token_id" in said and "generation_config.json" in said and said in done.stderr
        checked = osdpipe(tmp_path, "check", out)
        assert checked.returncode == 0, checked.stdout + checked.stderr
