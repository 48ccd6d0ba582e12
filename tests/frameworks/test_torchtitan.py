"""Real torchtitan saves, the ``osdpipe`` command converts, real torchtitan resumes (issue 30).

torchtitan 0.3.0's own trainer trains its default ``llama3`` ``debugmodel``
(fused ``wqkv``, saved by its hooks as ``wq``/``wk``/``wv``) with FSDP2 on
CPU/gloo (:mod:`frameworks.titan`). osdpipe converts the checkpoint folder as
a user would, naming the model torchtitan's way. torchtitan then resumes from
the output with its own ``--checkpoint.folder``, and the state it loaded,
gathered whole, equals the state it loads from the source, bit for bit; one
more step gives a finite loss (the same loss, where the data-parallel degree
and so the data order are the source's).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from frameworks import titan
from helpers import run_command, user_env

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

#: What a user runs for a torchtitan checkpoint of the default llama3 model (the target's world and the output added).
CONVERT = ["checkpoint=torchtitan", "model=torchtitan", "model.kwargs.name=llama3", "model.kwargs.flavor=debugmodel"]
#: What torchtitan is told when the data-parallel degree changed: its data loader's state is kept per dp rank.
NEW_DP_DEGREE = ["--checkpoint.exclude-from-loading", "dataloader"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """torchtitan on 4 ranks, 2 steps, a full checkpoint in folder A;
    and the state torchtitan loads from it on 4 ranks."""
    work = tmp_path_factory.mktemp("titan")
    assets = titan.make_assets(work / "assets")
    folder = work / "A"
    titan.train(work, 4, 2, folder=folder, assets=assets)
    loaded = titan.resume_and_dump(work, 4, folder, assets=assets, name="source")
    return work, assets, folder, loaded


def _convert(work: Path, name: str, *overrides: str, model: Sequence[str] = CONVERT) -> Path:
    """``osdpipe`` with ``overrides`` for torchtitan's checkpoint of the registry model ``model`` names."""
    out = work / name
    done = run_command(
        [sys.executable, "-m", "osdpipe", *model, *overrides, f"output.path={out}"],
        cwd=work,
        timeout=400,
        env=user_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _convert_as_inspect_says(work: Path, folder: Path | str, world_size: int, into: Path | str) -> Path | str:
    """The command ``osdpipe inspect`` prints for ``folder`` (a path or a URL), run verbatim with only the target's
    world and the output (``into``: a path or a URL) filled in; it names the model as torchtitan does
    (``checkpoint.model``, ``checkpoint.flavor``), where the module's own tests name it by ``model=torchtitan``
    (:data:`CONVERT`)."""
    shown = run_command(
        [sys.executable, "-m", "osdpipe", "inspect", str(folder)], cwd=work, timeout=120, env=user_env()
    )
    assert shown.returncode == 0, shown.stderr
    (line,) = [line for line in shown.stdout.splitlines() if line.strip().startswith("convert with osdpipe ")]
    # the model, named as torchtitan names it
    assert "checkpoint.model=llama3 checkpoint.flavor=debugmodel" in line, line
    args = (
        line.strip()
        .removeprefix("convert with osdpipe ")
        .replace("target.world_size=M", f"target.world_size={world_size}")
        .replace("OUT_DIR", str(into))
        .split()
    )
    done = run_command([sys.executable, "-m", "osdpipe", *args], cwd=work, timeout=400, env=user_env())
    assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
    return into


@pytest.fixture(scope="module")
def two(source) -> Path:
    """The source converted to 2 ranks by the command ``osdpipe inspect`` prints for it (made once: two tests hold
    it against what torchtitan loads and against the same command's output in a bucket)."""
    work, _, folder, _ = source
    return _convert_as_inspect_says(work, folder, 2, work / "two")


def test_default_llama3_converts_4_to_2_and_back_to_4_and_torchtitan_resumes_each_at_its_step(source, two) -> None:
    work, assets, folder, want = source
    # where torchtitan's --checkpoint.folder resumes
    assert sorted(p.name for p in two.iterdir() if p.is_dir()) == ["step-2"]
    got = titan.resume_and_dump(work, 2, two, assets=assets, extra=NEW_DP_DEGREE, name="two")
    assert got["step"] == 2 and titan.compare_dumps(want, got) == []
    assert math.isfinite(got["loss_after"])

    four = _convert(work, "four", f"input.path={two / 'step-2'}", "target.world_size=4")
    # the source's dp degree: its data loader loads too
    got = titan.resume_and_dump(work, 4, four, assets=assets, name="four")
    assert titan.compare_dumps(want, got, parts=("step", "model", "optim", "lr_scheduler", "loss_after")) == []


def test_the_readmes_bucket_example_converts_into_the_bytes_it_makes_on_disk(source, two, monkeypatch) -> None:
    """README's object-storage line: torchtitan's checkpoint folder in a bucket (an S3 server on 127.0.0.1), named as
    torchtitan names its model, as ``osdpipe inspect s3://...`` prints the command, converts into another prefix: the
    files the same command writes on disk (which torchtitan resumes from, above), byte for byte."""
    from cloud.cloudenv import s3_bucket

    work, _, folder, _ = source
    with monkeypatch.context() as env, s3_bucket(env, work / "readme-home") as bucket:
        bucket.fs().put(f"{folder}/", f"{bucket.bucket}/titan/", recursive=True)
        _convert_as_inspect_says(work, bucket.url("titan"), 2, into=bucket.url("titan-2"))
        bucket.fs().get(f"{bucket.bucket}/titan-2/", f"{work / 'readme-s3'}/", recursive=True)

    def data(directory: Path) -> dict[str, bytes]:
        records = ("manifest.json", "report.json", "osdpipe.log")
        return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*")
                if p.is_file() and p.name not in records}  # fmt: skip

    assert data(work / "readme-s3") == data(two) and any(n.endswith(".distcp") for n in data(two))
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (two, work / "readme-s3")]
    assert manifests[0]["content_sha256"] == manifests[1]["content_sha256"]


def test_offline_to_8_ranks_resumes_on_2(source) -> None:
    """One process writes all 8 ranks' files; torchtitan on 2 ranks (another dp degree) loads them."""
    work, assets, folder, want = source
    eight = _convert(work, "eight", f"input.path={folder}", "target.world_size=8", "runtime.mode=offline")
    assert len(list((eight / "step-2").glob("*.distcp"))) == 8
    got = titan.resume_and_dump(work, 2, eight, assets=assets, extra=NEW_DP_DEGREE, name="eight")
    assert titan.compare_dumps(want, got) == []


def test_a_model_only_last_save_converts_to_a_model_only_step_that_torchtitan_initially_loads(source) -> None:
    """torchtitan's base config saves its last step model-only (``--checkpoint.last-save-model-only``): no optimizer,
    no train state. It converts to the same, which torchtitan's ``--checkpoint.initial-load-path`` loads (model only, at
    step 0)."""
    work, assets, _, _ = source
    saved = work / "model-only"
    titan.train(work, 2, 2, folder=saved, assets=assets, extra=["--checkpoint.last-save-model-only"])
    model_only = ["--checkpoint.initial-load-model-only"]
    want = titan.resume_and_dump(work, 2, saved / "step-2", assets=assets, extra=model_only, name="model-only-source")
    three = _convert_as_inspect_says(work, saved, 3, work / "model-only-3")
    assert not any(key.startswith("optimizer") for key in titan.checkpoint_keys(three / "step-2"))
    got = titan.resume_and_dump(work, 3, three / "step-2", assets=assets, extra=model_only, name="model-only-3")
    assert got["step"] == 0 and got["optim"] == {} and titan.compare_dumps(want, got, parts=("model",)) == []


def test_a_seed_checkpoint_converts_to_a_model_only_step_0_that_torchtitan_starts_from(source) -> None:
    """torchtitan's seed checkpoint (``--checkpoint.create-seed-checkpoint``, one process, the model unsharded, saved as
    ``step-0``; model-only as torchtitan's base config saves a last step, which llama3_debugmodel's config turns off)
    converts as ``inspect`` says to 2 ranks: a model-only ``step-0``, which torchtitan's ``--checkpoint.folder`` takes
    as a seed (step 0: model only) and loads, the model bit for bit the seed's own tensors, and trains on."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    work, assets, _, _ = source
    seed = work / "seed"
    titan.train(
        work,
        1,
        1,
        folder=seed,
        assets=assets,
        extra=["--checkpoint.create-seed-checkpoint", "--checkpoint.last-save-model-only"],
    )
    assert titan.latest_step(seed) == 0
    two = _convert_as_inspect_says(work, seed, 2, work / "seed-2")
    assert sorted(p.name for p in two.iterdir() if p.is_dir()) == ["step-0"]
    assert not any(key.startswith("optimizer") for key in titan.checkpoint_keys(two / "step-0"))
    got = titan.resume_and_dump(work, 2, two, assets=assets, name="seed-2")
    dcp_to_torch_save(str(seed / "step-0"), str(work / "seed.pt"))
    want = torch.load(work / "seed.pt", weights_only=True)
    assert got["step"] == 0 and set(got["model"]) == set(want), (
        "the model's own state-dict keys (wq, wk, wv of the fused wqkv)"
    )
    assert [key for key, value in want.items() if not titan.same_bits(got["model"][key], value)] == []
    assert math.isfinite(got["loss_after"])


def test_the_safetensors_export_is_what_torchtitans_own_hf_export_writes(source) -> None:
    """torchtitan's HF export of the same training (4 ranks, as the source; ``--checkpoint.last-save-in-hf``: Hugging
    Face's names, q/k permuted for its RoPE, the tied head left out) and osdpipe's export of the step folder hold the
    same tensors, bit for bit."""
    from safetensors.torch import load_file

    work, _, folder, _ = source
    hf = work / "hf"
    titan.train(
        work,
        4,
        2,
        folder=hf,
        assets=work / "assets",
        extra=["--checkpoint.last-save-model-only", "--checkpoint.last-save-in-hf"],
    )
    theirs: dict = {}
    for file in (hf / "step-2").glob("*.safetensors"):
        theirs.update(load_file(file))
    out = _convert(work, "export", f"input.path={folder}", "target.world_size=2", "output.model_format=safetensors")
    mine = load_file(out / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in mine and set(mine) == set(theirs)
    assert [name for name in theirs if not titan.same_bits(mine[name], theirs[name])] == []


def _to_megatron(work: Path, folder: Path, model: Sequence[str] = CONVERT) -> Path:
    """torchtitan's checkpoint ``folder`` (of the registry model ``model`` names) converted to Megatron at TP2 PP2 DP1,
    loaded by megatron-core on 4 ranks (its dump, logits and one step after beside it, ``megatron.*.pt``)."""
    from frameworks import mcore

    out = _convert(work, "megatron", f"input.path={folder}", "output.checkpoint=megatron", "target.tp_size=2",
                   "target.pp_size=2", "target.world_size=4", model=model)
    mcore.load(work, out, work / "megatron.loaded.pt", tp=2, pp=2, dp=1, dims_from_save=True, no_load_rng=True,
               logits=work / "megatron.logits.pt", resume=1, dump_after=work / "megatron.after.pt",
               label="load-titan-megatron")
    return out


@pytest.fixture(scope="module")
def megatron_save(source) -> Path:
    """The torchtitan checkpoint converted to Megatron at TP2 PP2 DP1 and loaded by megatron-core
    (:func:`_to_megatron`)."""
    work, _, folder, _ = source
    return _to_megatron(work, folder)


def _megatron_holds_and_computes(work: Path, loaded: dict, name: str, gpt, step: int) -> None:
    """megatron-core's load of :func:`_to_megatron` holds what torchtitan itself loads from the checkpoint (masters,
    moments, step) of its registry model ``name`` (``debugmodel``), mapped, bit for bit; its logits through its
    pipeline schedule are torchtitan's own forward of those weights within 1e-4 x max |logit| (``test_megatron_hf.py``
    says why); one more step moves every master."""
    from frameworks import mcore
    from frameworks.titan_llama_job import parameters

    from osdpipe.layout.llama_titan import from_titan, heads_of
    from osdpipe.layout.megatron_hf import from_hf
    from osdpipe.layout.models import build_model, torchtitan_flavor_args

    megatron = torch.load(work / "megatron.loaded.pt", weights_only=False)
    args = torchtitan_flavor_args(name, "debugmodel")
    state = loaded["optim"]["state"]
    titan_state = {"param": parameters(loaded["model"], args),
                   **{s: {n: v[s] for n, v in state.items()} for s in ("exp_avg", "exp_avg_sq")}}
    want = {s: from_hf(gpt, from_titan(heads_of(args), t)) for s, t in titan_state.items()}
    assert [f"{s} {k}" for s, ts in want.items() for k, t in ts.items()
            if not torch.equal(t, megatron["optim"][k][s])] == []
    assert sorted(megatron["optim"]) == sorted(want["param"])
    assert {float(s["step"]) for s in megatron["optim"].values()} == {float(step)} and megatron["iteration"] == step

    model = build_model("torchtitan", {"name": name, "flavor": "debugmodel"}).eval()
    model.load_state_dict(loaded["model"], strict=True)  # its own hooks fuse wq, wk, wv
    probe = torch.load(work / "megatron.logits.pt", weights_only=True)
    tokens = probe["tokens"]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        reference = model(tokens, positions, model.get_attention_masks(positions))
    diff = float((probe["logits"][..., : args["vocab_size"]] - reference).abs().max())
    print(f"max |Megatron TP2 PP2 - torchtitan {name} debugmodel| = {diff:.3g}, "
          f"max |logit| = {reference.abs().max():.3g}")
    assert diff <= 1e-4 * float(reference.abs().max()), diff
    assert mcore.trained_on(megatron, torch.load(work / "megatron.after.pt", weights_only=False), step=step) == []


@pytest.mark.skipif(__import__("importlib").util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_the_default_llama3_becomes_a_megatron_save_that_computes_its_logits_and_trains_on(source,
                                                                                           megatron_save) -> None:
    """torchtitan's own trainer's checkpoint of its default llama3 (debugmodel: 16 heads, RoPE theta 5e5 scaled as
    Llama 3.1) -> Megatron at TP2 PP2 DP1 (``output.checkpoint=megatron``; Megatron's ``--use-rope-scaling``).
    megatron-core 0.16.1, built from the save's args, holds it and computes it (:func:`_megatron_holds_and_computes`);
    the report says that Megatron's no-decay group for the norms is not the source's one group."""
    from osdpipe.layout.megatron import Gpt

    work, _, _, loaded = source
    gpt = Gpt(num_layers=6, hidden_size=256, ffn_hidden_size=768, num_attention_heads=16, num_query_groups=16,
              kv_channels=16, padded_vocab_size=2048, swiglu=True)
    _megatron_holds_and_computes(work, loaded, "llama3", gpt, step=2)
    report = json.loads((megatron_save / "report.json").read_text())
    assert any("the source's one param group decays every parameter" in w for w in report["warnings"])


#: What torchtitan's trainer is told to train its default qwen3 instead of llama3.
QWEN3 = ["--module", "qwen3", "--config", "qwen3_debugmodel"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_the_default_qwen3_becomes_a_megatron_save_that_computes_its_logits_and_trains_on(source,
                                                                                          tmp_path: Path) -> None:
    """torchtitan's own trainer trains its default qwen3 (debugmodel: 16 heads of 128 against a hidden size of 256,
    head norms, its output layer tied to the embedding) 2 steps on 2 ranks; its checkpoint, named as torchtitan names
    the model, converts to Megatron at TP2 PP2 DP1 (``--qk-layernorm --kv-channels 128``, tied), and megatron-core
    holds what torchtitan itself loads from it and computes it (:func:`_megatron_holds_and_computes`)."""
    from osdpipe.layout.megatron import Gpt

    assets = source[1]
    titan.train(tmp_path, 2, 2, folder=tmp_path / "Q", assets=assets, extra=QWEN3)
    loaded = titan.resume_and_dump(tmp_path, 2, tmp_path / "Q", assets=assets, name="qwen3", extra=QWEN3)
    _to_megatron(tmp_path, tmp_path / "Q", ["checkpoint=torchtitan", "checkpoint.model=qwen3",
                                            "checkpoint.flavor=debugmodel"])
    gpt = Gpt(num_layers=8, hidden_size=256, ffn_hidden_size=3072, num_attention_heads=16, num_query_groups=8,
              kv_channels=128, padded_vocab_size=2048, swiglu=True, tied=True, qk_layernorm=True)
    _megatron_holds_and_computes(tmp_path, loaded, "qwen3", gpt, step=2)


@pytest.mark.skipif(__import__("importlib").util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_the_megatron_save_of_a_rope_scaled_llama3_is_a_hugging_face_llama_of_its_logits(source,
                                                                                        megatron_save) -> None:
    """The way back, RoPE scaling kept: the Megatron save of torchtitan's debugmodel (``--use-rope-scaling``, from the
    test above) -> a Hugging Face folder (``output.checkpoint=hf``: transformers' ``llama3`` rope type) and a torchtitan
    step folder's ``model_args.json`` (torchtitan's ``llama`` scaling). transformers' own forward of the folder computes
    megatron-core's logits of the save within 1e-4 x max |logit|; the torchtitan model args are the debugmodel's own."""
    from frameworks import mcore

    from osdpipe.layout.models import torchtitan_flavor_args

    work = source[0]
    def back(name: str, *overrides: str) -> Path:
        done = run_command([sys.executable, "-m", "osdpipe", "checkpoint=megatron", f"input.path={megatron_save}",
                            *overrides, f"output.path={work / name}"], cwd=work, timeout=400, env=user_env())
        assert done.returncode == 0, done.stderr[-3000:]
        return work / name

    folder = back("megatron-hf", "output.checkpoint=hf")
    config = __import__("json").loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["rope_parameters"]["factor"] == 8.0
    diff, scale = mcore.hf_logits_gap(folder, torch.load(work / "megatron.logits.pt", weights_only=True))
    print(f"max |Megatron TP2 PP2 - HF llama3 rope| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= 1e-4 * scale, diff
    titan = back("megatron-titan", "output.checkpoint=torchtitan", "target.kind=fsdp2", "target.world_size=2")
    written = __import__("json").loads((titan / "model_args.json").read_text())
    own = torchtitan_flavor_args("llama3", "debugmodel")
    assert written["rope_scaling"] == own["rope_scaling"] and written["rope_theta"] == own["rope_theta"]
