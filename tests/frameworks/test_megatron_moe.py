"""A Megatron-Core mixture of experts changes its expert parallelism through osdpipe, optimizer included (issue 85).

Real megatron-core 0.16.1 trains the harness's GPT with 4 experts in every layer (SequentialMLP, top-2, the
``allgather`` dispatcher: :mod:`frameworks.mcore`) 3 steps on 2 CPU ranks and saves, at EP 2 (its optimizer a
ChainedOptimizer of the dense parameters' and the experts', over their expert DP ranks) in ``dp_reshardable`` and
``fully_reshardable``, and at EP 1 (the experts dense). The ``osdpipe`` command (a subprocess) converts each to
another EP, another DP at the same EP, and PP 2; megatron-core loads each output at its grid, as Megatron-LM's
``load_checkpoint`` does: every weight (the router and each expert at its global index), fp32 master, moment, step and
param group is bitwise the saving job's, and 2 more steps on synthetic gradients are bitwise what the saving job did
next. Megatron-core itself cannot load an EP 2 save at EP 1, nor an EP 1 save at EP 2 (one chained optimizer where the
save has two, and the other way round): osdpipe writes what the target job builds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from frameworks import mcore
from helpers import run_cli_cases

from osdpipe.io.formats.megatron import iteration_folder, read_common

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

#: The experts: 4 in every layer, top-2, each its own FFN size.
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}
#: (source, target EP, TP, PP, DP): every EP crossing megatron-core refuses, another DP at the same EP, and PP 2.
CASES = [
    ("ep2_dp", 1, 1, 1, 2),
    ("ep2_full", 1, 1, 1, 2),
    ("ep1_dp", 2, 1, 1, 2),
    ("ep2_dp", 4, 1, 1, 4),
    ("ep2_dp", 2, 1, 1, 4),
    ("ep2_dp", 1, 1, 2, 1),
]


@pytest.fixture(scope="module")
def moe_saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The real saves, by name: EP 2 (one job, saved ``dp_reshardable`` and ``fully_reshardable``) and EP 1, each
    with its truth (the gathered state) and its resume truth (2 synthetic steps on) beside it."""
    root = tmp_path_factory.mktemp("moe")
    saves = {name: root / name for name in ("ep2_dp", "ep2_full", "ep1_dp")}
    jobs = [
        mcore.save_argv(saves["ep2_dp"], tp=1, pp=1, sharding="dp_reshardable", resume_truth=2,
                        dump_after=_resumed(saves["ep2_dp"]), moe={**MOE, "ep": 2},
                        also=(("fully_reshardable", saves["ep2_full"], _resumed(saves["ep2_full"])),)),
        mcore.save_argv(saves["ep1_dp"], tp=1, pp=1, sharding="dp_reshardable", resume_truth=2,
                        dump_after=_resumed(saves["ep1_dp"]), moe={**MOE, "ep": 1}),
    ]  # fmt: skip
    mcore.each(root, 2, jobs, label="moe-saves", timeout=900)
    return saves


def _resumed(save: Path) -> Path:
    return save.with_suffix(".resumed.pt")


def _label(source: str, ep: int, tp: int, pp: int, dp: int) -> str:
    return f"{source}_to_ep{ep}_tp{tp}_pp{pp}_dp{dp}"


@pytest.fixture(scope="module")
def converted(moe_saves: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each case of :data:`CASES` converted by the command, then loaded by megatron-core at its grid and resumed 2
    steps (one launch per world size): by label, the command's outcome and the output folder."""
    root = tmp_path_factory.mktemp("moe_converted")
    (root / "work").mkdir()
    cases, labels = [], []
    for source, ep, tp, pp, dp in CASES:
        label = _label(source, ep, tp, pp, dp)
        cases.append(["checkpoint=megatron", f"input.path={moe_saves[source]}", f"target.tp_size={tp}",
                      f"target.pp_size={pp}", f"target.ep_size={ep}", f"target.world_size={tp * pp * dp}",
                      f"output.path={root / label}"])  # fmt: skip
        labels.append(label)
    outcome, loads = {}, {}
    for label, (source, ep, tp, pp, dp), done in zip(labels, CASES, run_cli_cases(cases, cwd=root / "work",
                                                                                  per_case_s=240), strict=True):
        folder = root / label
        outcome[label] = {**done, "folder": folder}
        if done["code"] == 0:
            loads.setdefault(tp * pp * dp, []).append(mcore.load_argv(
                folder, folder.with_suffix(".pt"), tp=tp, pp=pp, resume=2, dump_after=folder.with_suffix(".resumed.pt"),
                dims_from_save=True, moe={"ep": ep}))  # fmt: skip
    for world, jobs in sorted(loads.items()):
        mcore.each(root, world, jobs, label=f"moe-load-{world}", timeout=900)
    return outcome


@pytest.mark.parametrize(("source", "ep", "tp", "pp", "dp"), CASES,
                         ids=[_label(*case) for case in CASES])  # fmt: skip
def test_megatron_core_loads_every_ep_conversion_bitwise_and_resumes_as_the_saving_job(
    moe_saves: dict[str, Path], converted: dict[str, dict], source: str, ep: int, tp: int, pp: int, dp: int
) -> None:
    done = converted[_label(source, ep, tp, pp, dp)]
    assert done["code"] == 0, done["stderr"][-3000:]
    folder = done["folder"]
    args = read_common(iteration_folder(folder))["args"]
    grid = [args[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                              "expert_model_parallel_size", "expert_tensor_parallel_size", "num_experts")]
    assert grid == [tp, pp, dp, ep, tp, MOE["num_experts"]]
    truth = torch.load(mcore.truth_path(moe_saves[source]), weights_only=False)
    resumed = torch.load(_resumed(moe_saves[source]), weights_only=False)
    got = torch.load(folder.with_suffix(".pt"), weights_only=False)
    got_after = torch.load(folder.with_suffix(".resumed.pt"), weights_only=False)
    experts = [k for k in truth["model"] if ".experts." in k]
    assert experts and {k for k in truth["model"] if "router" in k}, sorted(truth["model"])  # the test sees them
    assert mcore.dump_differences(truth, got) == []
    assert mcore.dump_differences(resumed, got_after) == []


def test_a_changed_expert_fails_the_load_comparison(moe_saves: dict[str, Path]) -> None:
    """The comparison above sees one expert element: the saving job's truth with one element of one expert changed
    differs from itself."""
    truth = torch.load(mcore.truth_path(moe_saves["ep2_dp"]), weights_only=False)
    changed = torch.load(mcore.truth_path(moe_saves["ep2_dp"]), weights_only=False)
    key = next(k for k in changed["model"] if ".experts." in k)
    changed["model"][key].view(-1)[-1] += 1.0
    assert mcore.dump_differences(truth, changed) != []


def test_bad_expert_parallelism_and_moe_outside_megatron_are_refused_in_one_line_and_write_nothing(
    moe_saves: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    grid = ["checkpoint=megatron", f"input.path={moe_saves['ep2_dp']}", f"output.path={out}"]
    cases = {
        "target.ep_size=3 does not divide the model's 4 experts; choose one that does: 1, 2": [
            *grid, "target.ep_size=3", "target.world_size=6"],
        "ep_size=4 does not divide the 2 data-parallel ranks": [*grid, "target.ep_size=4", "target.world_size=2"],
        "target.ep_size=2: expert-parallel ranks are Megatron's": [
            "checkpoint=megatron", f"input.path={moe_saves['ep2_dp']}", "output.checkpoint=pytorch",
            "target.kind=fsdp2", "target.ep_size=2", f"output.path={out}"],
        "a mixture of experts (num_experts): not supported yet as a LlamaForCausalLM (output.checkpoint=hf|": [
            "checkpoint=megatron", f"input.path={moe_saves['ep2_dp']}", "output.checkpoint=hf", f"output.path={out}"],
        "a mixture of experts (num_experts): not supported yet as a LlamaForCausalLM (": [
            "checkpoint=megatron", f"input.path={moe_saves['ep2_dp']}", "output.checkpoint=pytorch",
            "target.kind=fsdp2", "target.world_size=2", f"output.path={out}"],
    }  # fmt: skip
    for said, result in zip(cases, run_cli_cases(list(cases.values()), cwd=tmp_path), strict=True):
        assert result["code"] == 2, (said, result)
        lines = result["stderr"].strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (said, result["stderr"])
        assert not out.exists(), said


def test_inspect_names_the_experts_and_the_ep_that_keeps_them(moe_saves: dict[str, Path], tmp_path: Path) -> None:
    from helpers import run_command, user_env

    done = run_command([sys.executable, "-m", "osdpipe", "inspect", str(moe_saves["ep2_dp"])], cwd=tmp_path,
                       timeout=120, env=user_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TP1 PP1 DP2 (world 2), EP2" in done.stdout
    assert ("mixture of experts: 4 experts in every layer (moe_layer_freq 1), top-2, each of ffn 48; EP2, expert "
            "TP1; to keep EP2, add target.ep_size=2") in done.stdout, done.stdout
