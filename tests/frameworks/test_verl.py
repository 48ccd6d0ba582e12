"""Real veRL saves, the ``osdpipe`` command converts, veRL itself resumes on another number of ranks (issue 86).

veRL 0.9.1's own ``FSDPCheckpointManager`` saves an FSDP2 actor of the test's own Llama on 2 CPU ranks
(:mod:`frameworks.verl_job`), as ``global_step_<N>/actor/`` of a run folder, and takes two more steps. veRL itself
loads it only on 2 ranks (it opens ``..._world_size_2_...``). osdpipe converts the run folder, without veRL's code,
into veRL's own folder for 4, 1 and 3 ranks (offline in a memory budget for 4) and for 2; veRL's own
``load_checkpoint`` in a job of that many ranks holds, gathered whole, the saving job's weights, moments, steps and
param groups bit for bit, and its two more steps match the saving job's (bitwise at 2 ranks; within a tolerance for
another reduction order elsewhere). Into PyTorch's layout, a PyTorch FSDP2 job loads it the same way. Each bad folder
is refused in one line that names the file, before anything is written.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from frameworks.launch import run_logged, torchrun, worker_env
from helpers import run_command, user_env

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

ENTRY = Path(__file__).resolve().parent / "verl_job.py"
STEPS = 3


def _job(work: Path, label: str, nproc: int, **spec: Any) -> None:
    run_logged(torchrun(nproc, ENTRY, spec), work, label=label, timeout=600, what="veRL job", env=worker_env())


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """veRL's run folder: ``global_step_3/actor/`` as its manager saved it on 2 ranks, and the file naming the newest
    step, as veRL's trainer writes it; the saving job's state, gathered whole, in ``expected.pt`` beside it."""
    root = tmp_path_factory.mktemp("verl")
    run = root / "run"
    _job(root, "save", 2, mode="save", steps=STEPS, path=str(run / f"global_step_{STEPS}" / "actor"),
         dump=str(root / "expected.pt"))  # fmt: skip
    (run / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    return run


@pytest.fixture(scope="module")
def fsdp1_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An actor folder veRL's manager saved from an FSDP1 job (veRL's default ``actor.strategy=fsdp``: its own wrap
    policy, flat parameters, ShardedTensor model files) on 2 ranks; the job's state, gathered whole, beside it."""
    root = tmp_path_factory.mktemp("verl_fsdp1")
    _job(root, "save", 2, mode="save", fsdp=1, steps=STEPS, path=str(root / "actor"),
         dump=str(root / "expected.pt"))  # fmt: skip
    return root / "actor"


def _differences(expected: Any, got: Any, where: str = "") -> list[str]:
    """Where two gathered states differ: tensors bitwise (dtype too), everything else by ``==``."""
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return [f"{where}: keys {sorted(map(str, expected))} vs {sorted(map(str, got or {}))}"]
        return [d for k in expected for d in _differences(expected[k], got[k], f"{where}.{k}")]
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(got):
            return [f"{where}: {len(expected)} items vs {len(got)}"]
        return [d for i, (a, b) in enumerate(zip(expected, got)) for d in _differences(a, b, f"{where}[{i}]")]
    if torch.is_tensor(expected):
        same = torch.is_tensor(got) and expected.dtype == got.dtype and torch.equal(expected, got)
        return [] if same else [f"{where}: differs"]
    return [] if expected == got else [f"{where}: {expected!r} vs {got!r}"]


def _convert(run: Path, out: Path, world: int, *overrides: str) -> str:
    done = run_command(
        [sys.executable, "-m", "osdpipe", "checkpoint=verl", f"input.path={run}", f"target.world_size={world}",
         *overrides, f"output.path={out}"],
        cwd=out.parent, timeout=400, env=user_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _after_matches(expected: Any, got: Any, bitwise: bool) -> list[str]:
    """Where the two more steps' states differ: bitwise, or within float32's error for another reduction order."""
    if bitwise:
        return _differences(expected, got, "after")
    flat_e, flat_g = _leaves(expected), _leaves(got)
    if flat_e.keys() != flat_g.keys():
        return [f"after: keys {sorted(flat_e)} vs {sorted(flat_g)}"]
    out = []
    for key, e in flat_e.items():
        g = flat_g[key]
        close = (torch.is_tensor(e) and torch.is_tensor(g) and e.dtype == g.dtype
                 and torch.allclose(e.double(), g.double(), rtol=1e-4, atol=1e-6)) if torch.is_tensor(e) else (
                 math.isclose(e, g, rel_tol=1e-5) if isinstance(e, float) else e == g)  # fmt: skip
        if not close:
            out.append(f"after{key}: {e!r} vs {g!r}"[:300])
    return out


def _leaves(state: Any, where: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _leaves(value, f"{where}.{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _leaves(value, f"{where}[{i}]").items()}
    return {where: state}


def _loaded_as_saved(run_folder: Path, tmp_path: Path, out: Path, world: int, mode: str, *,
                     bitwise_after: bool | None = None) -> None:
    """A job of ``world`` ranks loads ``out`` (``mode``: veRL's manager, or as PyTorch's layout) and holds the saving
    job's state bitwise; veRL's own resumes the scheduler too, so its two more steps match the saving job's (PyTorch's
    layout has no place for it: that job's scheduler starts afresh, and it only trains on)."""
    _job(tmp_path, mode, world, mode=mode, path=str(out), steps=STEPS, dump=str(tmp_path / "loaded.pt"))
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    expected = torch.load(run_folder.parent / "expected.pt", weights_only=False)
    if bitwise_after is False:  # another kind of job (FSDP1): its param groups list the parameters in its own order
        for state in (expected, loaded, expected["after"], loaded["after"]):
            for group in state["optim"]["param_groups"]:
                group["params"] = sorted(group["params"])
    assert _differences(expected["model"], loaded["model"], "model") == []
    assert _differences(expected["optim"], loaded["optim"], "optim") == []
    if mode == "load":
        bitwise = world == 2 if bitwise_after is None else bitwise_after
        assert _after_matches(expected["after"], loaded["after"], bitwise=bitwise) == []
    else:
        assert all(math.isfinite(loss) for loss in loaded["after"]["losses"])


@pytest.mark.parametrize(
    ("world", "overrides"),
    [(4, ("runtime.mode=offline", "runtime.memory_budget=64KB")), (1, ()), (3, ()), (2, ())],
    ids=["4 ranks offline in a budget", "1 rank", "3 ranks", "2 ranks (bitwise after two steps)"],
)
def test_verl_resumes_its_own_save_on_another_number_of_ranks(
    run_folder: Path, tmp_path: Path, world: int, overrides: tuple[str, ...]
) -> None:
    said = _convert(run_folder, tmp_path / "out", world, *overrides)
    for check in ("roundtrip", "resume"):
        assert f"check {check}" in said and f"check {check}     fail" not in said, said
    out = tmp_path / "out"
    actor = run_folder / f"global_step_{STEPS}" / "actor"
    assert sorted(p.name for p in out.glob("*_world_size_*")) == sorted(
        f"{kind}_world_size_{world}_rank_{r}.pt" for kind in ("model", "optim", "extra_state") for r in range(world)
    )
    assert json.loads((out / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": world}
    assert (out / "huggingface" / "config.json").read_bytes() == (actor / "huggingface" / "config.json").read_bytes()
    for r in range(world):  # each rank's extra state: its own saving rank's, or rank r mod 2's beyond the two
        assert (out / f"extra_state_world_size_{world}_rank_{r}.pt").read_bytes() == (
            actor / f"extra_state_world_size_2_rank_{r % 2}.pt").read_bytes()  # fmt: skip
    fates = {e["name"]: e["fate"] for e in json.loads((out / "report.json").read_text())["entries"]}
    assert fates["extra_state.rank_1"].startswith("copied: target rank r takes the extra state")
    assert fates["fsdp_config.json"].startswith("written anew")
    _loaded_as_saved(run_folder, tmp_path, out, world, "load")


def test_veRLs_folder_written_by_osdpipe_converts_back_to_the_saving_worlds_files(
    run_folder: Path, tmp_path: Path
) -> None:
    """2 -> 3 -> 2 ranks gives back every rank file of the save: each local tensor bitwise, each DTensor's shape,
    placements and mesh (device type, ranks, dimension names), each param group; the extra state byte for byte."""
    from osdpipe.io.checkpoints.verl_files import local_view

    _convert(run_folder, tmp_path / "three", 3)
    # osdpipe's own load of the written files (check --load: a world of 3 ranks, each rank's files as veRL reads them)
    done = run_command([sys.executable, "-m", "osdpipe", "check", str(tmp_path / "three"), "--load"],
                       cwd=tmp_path, timeout=300, env=user_env())  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "check load       pass  on 3 fsdp2 rank(s)" in done.stdout, said
    _convert(tmp_path / "three", tmp_path / "back", 2)
    actor, back = run_folder / f"global_step_{STEPS}" / "actor", tmp_path / "back"
    for name in (f"{kind}_world_size_2_rank_{r}.pt" for kind in ("model", "optim") for r in range(2)):
        saved, got = (local_view(torch.load(d / name, weights_only=False)) for d in (actor, back))
        assert _differences(saved, got, name) == []
    for r in range(2):
        name = f"extra_state_world_size_2_rank_{r}.pt"
        assert (back / name).read_bytes() == (actor / name).read_bytes()


def test_an_fsdp1_actor_resumes_as_veRLs_fsdp2_on_another_number_of_ranks(fsdp1_folder: Path, tmp_path: Path) -> None:
    """veRL's default FSDP1 actor (flat parameters, ShardedTensor model files) at 2 ranks becomes veRL's FSDP2 folder
    for 3: veRL's own manager loads it in an FSDP2 job (actor.strategy=fsdp2) holding the FSDP1 job's weights and Adam
    state bitwise, and two more steps match the FSDP1 job's within float32's error."""
    said = _convert(fsdp1_folder, tmp_path / "out", 3)
    for check in ("roundtrip", "resume"):
        assert f"check {check}" in said and f"check {check}     fail" not in said, said
    assert "the output is veRL's FSDP2 folder (osdpipe writes no ShardedTensor files): resume it with " \
           "actor.strategy=fsdp2" in said
    out = tmp_path / "out"
    assert json.loads((out / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 3}
    _loaded_as_saved(fsdp1_folder, tmp_path, out, 3, "load", bitwise_after=False)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_a_verl_save_becomes_a_megatron_save_that_megatron_core_loads_bitwise_and_trains_on(
    run_folder: Path, tmp_path: Path
) -> None:
    """veRL -> Megatron-Core (the model's dimensions from huggingface/config.json): the real megatron-core job loads it
    at TP1 PP1 DP2 and holds the veRL job's fp32 weights as its masters, and its moments and step, mapped by
    ``from_hf``, bitwise; and takes a step on."""
    from frameworks import mcore

    from osdpipe.layout.megatron import Gpt
    from osdpipe.layout.megatron_hf import from_hf

    out = tmp_path / "megatron"
    said = _convert(run_folder, out, 2, "output.checkpoint=megatron")
    assert "check roundtrip  pass" in said and "check resume     pass" in said, said
    mcore.each(tmp_path, 2, [mcore.load_argv(out, tmp_path / "loaded.pt", tp=1, pp=1, dims_from_save=True,
                                             no_load_rng=True, resume=1, dump_after=tmp_path / "after.pt")],
               label="load")  # fmt: skip
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    expected = torch.load(run_folder.parent / "expected.pt", weights_only=False)
    gpt = Gpt(num_layers=2, hidden_size=24, ffn_hidden_size=40, num_attention_heads=4, num_query_groups=2,
              kv_channels=6, padded_vocab_size=128, swiglu=True)  # the test's Llama, its vocabulary padded for TP1
    states = expected["optim"]["state"]
    want = {"param": from_hf(gpt, expected["model"]),
            **{s: from_hf(gpt, {k: v[s] for k, v in states.items()}) for s in ("exp_avg", "exp_avg_sq")}}
    assert [f"{s} {k}" for s, tensors in want.items() for k, t in tensors.items()
            if not torch.equal(t, loaded["optim"][k][s])] == []  # fmt: skip
    assert [k for k, t in want["param"].items() if not torch.equal(t, loaded["model"][k])] == []
    assert {float(state["step"]) for state in loaded["optim"].values()} == {float(STEPS)}
    after = torch.load(tmp_path / "after.pt", weights_only=False)
    assert {float(state["step"]) for state in after["optim"].values()} == {STEPS + 1.0}
    assert all(torch.isfinite(t).all() for t in after["model"].values() if torch.is_tensor(t))


def test_a_verl_save_resumes_bitwise_as_pytorchs_layout(run_folder: Path, tmp_path: Path) -> None:
    """Into PyTorch's layout for 3 ranks, with the weights as ``model.safetensors`` too, which transformers loads
    (``from_pretrained`` of the folder, with the copied ``huggingface/`` config) holding the saving job's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    said = _convert(run_folder, tmp_path / "out", 3, "output.checkpoint=pytorch", "output.model_format=safetensors")
    for check in ("roundtrip", "resume"):
        assert f"check {check}" in said and f"check {check}     fail" not in said, said
    assert f"converting the newest, {run_folder / f'global_step_{STEPS}' / 'actor'}" in said
    out = tmp_path / "out"
    source_config = run_folder / f"global_step_{STEPS}" / "actor" / "huggingface" / "config.json"
    assert (out / "huggingface" / "config.json").read_bytes() == source_config.read_bytes()
    report = json.loads((out / "report.json").read_text())
    fates = {e["name"]: e["fate"] for e in report["entries"]}
    assert fates["extra_state.rank_1"].startswith("left out: veRL's learning-rate scheduler state and RNG states")
    assert fates["fsdp_config.json"].startswith("left out")
    refused = run_command([sys.executable, "-m", "osdpipe", "checkpoint=verl", f"input.path={run_folder}",
                           "output.checkpoint=hf", f"output.path={tmp_path / 'hf'}"], cwd=tmp_path, timeout=200,
                          env=user_env())  # fmt: skip
    assert refused.returncode == 2 and "set output.model_format=safetensors" in refused.stderr, refused.stderr
    model = AutoModelForCausalLM.from_pretrained(  # no generation_config.json: transformers 5.23 fails to say so
        out, config=AutoConfig.from_pretrained(out / "huggingface"), generation_config=GenerationConfig()
    )
    expected = torch.load(run_folder.parent / "expected.pt", weights_only=False)["model"]
    assert _differences(expected, dict(model.state_dict()), "model.safetensors") == []
    _loaded_as_saved(run_folder, tmp_path, out, 3, "load_pytorch")


def _copy(run_folder: Path, tmp_path: Path) -> Path:
    actor = tmp_path / "actor"
    shutil.copytree(run_folder / f"global_step_{STEPS}" / "actor", actor)
    return actor


def _break_missing(actor: Path) -> str:
    (actor / "optim_world_size_2_rank_1.pt").unlink()
    return "optim_world_size_2_rank_1.pt is missing"


def _break_extra(actor: Path) -> str:
    (actor / "extra_state_world_size_2_rank_1.pt").unlink()
    return "extra_state_world_size_2_rank_1.pt is missing (1 of the 2 ranks' extra_state files are there)"


def _break_mixed(actor: Path) -> str:
    shutil.copy(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_4_rank_0.pt")
    return "holds the files of world sizes 2, 4 together"


def _break_config(actor: Path) -> str:
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    return "fsdp_config.json says world_size=4, but the rank files are of world size 2"


def _break_version(actor: Path) -> str:
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 3, "world_size": 2}))
    return "FSDP_version=3: veRL saves FSDP_version 1 (actor.strategy=fsdp) or 2 (fsdp2)"


def _break_megatron(actor: Path) -> str:
    (actor / "ckpt_contents.json").write_text("{}")
    return "a veRL Megatron backend's checkpoint: not supported yet"


def _break_cuda(actor: Path) -> str:
    """Rank 0's DTensors as a GPU job's: their mesh's device type ``cuda`` (set on the unpickled mesh: this machine
    has no CUDA to make one on)."""
    path = actor / "model_world_size_2_rank_0.pt"
    state = torch.load(path, weights_only=False)
    next(iter(state.values())).device_mesh._device_type = "cuda"  # every DTensor of the file shares the one mesh
    torch.save(state, path)
    return "osdpipe writes veRL's own files for a job on CPU meshes only so far"


def _break_hsdp(actor: Path) -> str:
    """Rank 0's first DTensor on a two-dimensional (HSDP) mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = DeviceMesh("cpu", torch.arange(2).view(1, 2), mesh_dim_names=("ddp", "fsdp"), _init_backend=False, _rank=0)
    value = DTensor.from_local(torch.zeros(4, 3), mesh, [Replicate(), Shard(0)], run_check=False, shape=(8, 3),
                               stride=(3, 1))  # fmt: skip
    torch.save({"model.embed_tokens.weight": value}, actor / "model_world_size_2_rank_0.pt")
    return "its DTensors lie on a 2-dimensional mesh (1, 2) (HSDP"


@pytest.mark.parametrize("broken", [_break_missing, _break_extra, _break_mixed, _break_config, _break_version,
                                    _break_megatron, _break_cuda, _break_hsdp],
                         ids=["a missing rank file", "a missing extra state file", "two world sizes",
                              "a contradicting fsdp_config.json", "an FSDP version veRL has not",
                              "the Megatron backend", "a GPU job's meshes", "HSDP"])  # fmt: skip
def test_a_bad_verl_folder_is_refused_in_one_line_before_anything_is_written(
    run_folder: Path, tmp_path: Path, broken: Any
) -> None:
    actor = _copy(run_folder, tmp_path)
    said = broken(actor)
    out = tmp_path / "out"
    done = run_command(
        [sys.executable, "-m", "osdpipe", "checkpoint=verl", f"input.path={actor}", "target.world_size=3",
         f"output.path={out}"],
        cwd=tmp_path, timeout=200, env=user_env(),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0] and str(actor) in lines[0], done.stderr
    assert not out.exists()


def test_inspect_names_the_run_folders_newest_actor_and_prints_the_command_that_converts_it(
    run_folder: Path, tmp_path: Path
) -> None:
    done = run_command([sys.executable, "-m", "osdpipe", "inspect", str(run_folder)], cwd=tmp_path, timeout=200,
                       env=user_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    actor = run_folder / f"global_step_{STEPS}" / "actor"
    assert "layout       verl" in done.stdout and "veRL FSDP2 checkpoint of 2 rank(s)" in done.stdout
    assert f"osdpipe checkpoint=verl input.path={actor} target.world_size=M output.path=OUT_DIR" in done.stdout
    assert "DeviceMesh" not in done.stderr  # torch's warning for each saved mesh read as data
