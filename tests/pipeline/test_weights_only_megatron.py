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

from osdpipe.io import hf_folder
from osdpipe.io.formats.megatron import gpt_of, read_save
from osdpipe.layout import megatron_hf
from osdpipe.verify.megatron import hf_source_problems


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
    assert "weights alone" in json.loads((tmp_path / "pp2" / "report.json").read_text())["checks"][0]["detail"]
    back = osdpipe(tmp_path, "checkpoint=megatron", "input.path=pp2", "output.checkpoint=hf", "output.path=hf2")
    assert back.returncode == 0, back.stderr
    assert all(torch.equal(t, hf_folder.read_weights(tmp_path / "hf2")[k]) for k, t in state.items())
    refused = osdpipe(tmp_path, "checkpoint=megatron", "input.path=pp2", "target.tp_size=2", "target.world_size=2",
                      "output.megatron_optim_format=fully_reshardable", "output.path=optim")
    assert refused.returncode == 1 and "no optimizer state" in refused.stderr


@pytest.mark.parametrize("case", ["no_config", "bin_only", "mistral", "tp3", "optim_format", "pytorch_out"])
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
             "pytorch_out": ["output.checkpoint=pytorch"]}.get(case, [])
    done = osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.world_size=2", *extra,
                   "output.path=out")
    said = {"no_config": "config.json", "bin_only": "save_pretrained(safe_serialization=True)",
            "mistral": "not a LlamaForCausalLM", "tp3": "does not divide the model's 4 attention heads",
            "optim_format": "holds no optimizer state", "pytorch_out": "set output.checkpoint=megatron"}
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




class _State(dict):
    """A source state's tensors, as a reader returns them: a dict that can be watched for being let go."""


def test_the_source_is_asked_one_state_at_a_time_and_each_let_go_before_the_next(tmp_path: Path) -> None:
    """hf_source_problems holds a Megatron save with Adam's state against the Hugging Face source's, one state at a
    time: the source's tensors of a state are let go before the next state's are asked for (what keeps the verify
    stage of HF -> Megatron from holding a second copy of the source), and one wrong element of a moment is named."""
    import dataclasses
    import gc
    import weakref

    state = write_llama(tmp_path / "hf")
    assert osdpipe(tmp_path, "checkpoint=hf", "input.path=hf", "target.tp_size=2", "target.world_size=2",
                   "output.path=out").returncode == 0
    weights_only = read_save(tmp_path / "out")
    gpt = gpt_of(weights_only.args)
    torch.manual_seed(0)
    moments = {m: {k: torch.randn_like(t) for k, t in state.items()} for m in ("exp_avg", "exp_avg_sq")}
    hf = {"weights": state, **moments}
    padded = int(weights_only.args["padded_vocab_size"])
    mapped = {s: megatron_hf.from_hf(gpt, tensors, padded) for s, tensors in hf.items()}
    save = dataclasses.replace(weights_only, sharding="fully_reshardable", optim={
        k: {"param": mapped["weights"][k], "exp_avg": mapped["exp_avg"][k], "exp_avg_sq": mapped["exp_avg_sq"][k]}
        for k in mapped["weights"]})
    asked: list[str] = []
    last: list[weakref.ref] = []
    off: list[tuple[str, str, int]] = []  # (state, name, index): an element the source holds one higher

    def source(name: str) -> _State:
        gc.collect()
        assert not last or last[-1]() is None, f"{asked[-1]}'s tensors were still held when {name}'s were asked for"
        asked.append(name)
        got = _State({k: t.clone() for k, t in hf[name].items()})
        for state_name, key, index in off:
            if state_name == name:
                got[key].view(-1)[index] += 1.0
        last.append(weakref.ref(got))
        return got

    assert hf_source_problems(gpt, 50, source, 0.0, [], save) == []
    assert asked == ["weights", "exp_avg", "exp_avg_sq"]
    off.append(("exp_avg_sq", "model.norm.weight", 7))
    last.clear()
    assert hf_source_problems(gpt, 50, source, 0.0, [], save) == [
        "exp_avg_sq model.norm.weight: differs from the Hugging Face source's"]
