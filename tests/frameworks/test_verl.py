"""Real veRL saves, the ``osdpipe`` command converts, a PyTorch FSDP2 job of another world size resumes (issue 86).

veRL 0.9.1's own ``FSDPCheckpointManager`` saves an FSDP2 actor of the test's own Llama on 2 CPU ranks
(:mod:`frameworks.verl_job`), as ``global_step_<N>/actor/`` of a run folder. veRL itself loads it only on 2 ranks
(it opens ``..._world_size_2_...``). osdpipe converts the run folder, without veRL's code, to PyTorch's layout for 3
ranks (uneven shards) and, offline in a memory budget, for 4; a fresh FSDP2 job of that size loads it as a PyTorch
job does and holds, gathered whole, the saving job's weights, moments, steps and param groups bit for bit, and takes
one more step. Each bad folder is refused in one line that names the file, before anything is written.
"""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("world", "overrides"),
    [(3, ()), (4, ("runtime.mode=offline", "runtime.memory_budget=64KB"))],
    ids=["3 ranks", "4 ranks offline in a budget"],
)
def test_a_verl_save_resumes_bitwise_on_another_number_of_ranks(
    run_folder: Path, tmp_path: Path, world: int, overrides: tuple[str, ...]
) -> None:
    said = _convert(run_folder, tmp_path / "out", world, *overrides)
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

    _job(tmp_path, "load", world, mode="load", path=str(out), dump=str(tmp_path / "loaded.pt"))
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    expected = torch.load(run_folder.parent / "expected.pt", weights_only=False)
    assert _differences(expected["model"], loaded["model"], "model") == []
    assert _differences(expected["optim"], loaded["optim"], "optim") == []
    assert math.isfinite(loaded["loss_after"])


def _copy(run_folder: Path, tmp_path: Path) -> Path:
    actor = tmp_path / "actor"
    shutil.copytree(run_folder / f"global_step_{STEPS}" / "actor", actor)
    return actor


def _break_missing(actor: Path) -> str:
    (actor / "optim_world_size_2_rank_1.pt").unlink()
    return "optim_world_size_2_rank_1.pt is missing"


def _break_mixed(actor: Path) -> str:
    shutil.copy(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_4_rank_0.pt")
    return "holds the files of world sizes 2, 4 together"


def _break_config(actor: Path) -> str:
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    return "fsdp_config.json says world_size=4, but the rank files are of world size 2"


def _break_fsdp1(actor: Path) -> str:
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 2}))
    return "FSDP_version=1: a veRL FSDP1 checkpoint (ShardedTensor state) is not supported yet"


def _break_megatron(actor: Path) -> str:
    (actor / "ckpt_contents.json").write_text("{}")
    return "a veRL Megatron backend's checkpoint: not supported yet"


@pytest.mark.parametrize("broken", [_break_missing, _break_mixed, _break_config, _break_fsdp1, _break_megatron],
                         ids=["a missing rank file", "two world sizes", "a contradicting fsdp_config.json",
                              "FSDP1", "the Megatron backend"])  # fmt: skip
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
