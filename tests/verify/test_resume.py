"""Output that resumes exactly: a user's FSDP1 checkpoint, converted by the command, trained on by the resuming job.

The source is what plain PyTorch code saves: ``userlm`` (token IDs into an
``nn.Embedding``, a head tied to it, a factory without arguments) wrapped in
FSDP1 over its ``MixerBlock`` units on 2 ranks, 3 steps of Adam or AdamW
with a real backward, ``FSDP.optim_state_dict`` (FULL) saved with
``torch.save``. That file shares one ``step`` tensor across each unit's
parameters, and ``torch.save`` keeps the sharing: the trap.

Each conversion runs through the ``osdpipe`` command (no ``optim.name``:
the checkpoint's own optimizer), and must pass its ``resume`` check. Then,
independently of osdpipe's checks:

* every output format, loaded with ``torch.load`` (DCP through PyTorch's
  ``dcp_to_torch_save``), holds no storage two parameters share;
* the resuming job, written here with plain PyTorch (``fully_shard``, FSDP1
  ``use_orig_params``, DDP, the unwrapped model), loads the output as the
  README says and trains 2 steps on real batches (the same on every rank, so
  data parallelism changes nothing); every step counter is then the source's
  + 2, and every state tensor and parameter equals an unwrapped model that
  loaded the source state (every tensor its own) and took the same steps.
  Data-parallel gradients are averaged across ranks, so the moments and
  parameters are compared to within float rounding; the step counters exactly.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import userlm
from helpers import run_cli_cases, user_env

from osdpipe.run.launch import run_local_world

#: End to end: it starts worlds, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

TIMEOUT_S = 240
TESTS = Path(__file__).resolve().parents[1] / "support"
SOURCE_STEPS, RESUME_STEPS = 3, 2
OPTIMIZERS = {"Adam": {}, "AdamW": {"weight_decay": 0.1}}

# case -> (optimizer of the source, the command's target arguments, what the resuming job is)
CASES: dict[str, tuple[str, list[str], str]] = {
    "adam-fsdp2-2": ("Adam", ["target.kind=fsdp2", "target.world_size=2"], "fsdp2"),
    "adam-fsdp2-3": ("Adam", ["target.kind=fsdp2", "target.world_size=3"], "fsdp2"),
    "adam-orig_params-2": ("Adam", ["target.world_size=2", "target.use_orig_params=true"], "fsdp1_orig"),
    "adam-none": ("Adam", ["target.kind=none", "target.world_size=1", "output.format=plain"], "none"),
    "adam-ddp-2": ("Adam", ["target.kind=ddp", "target.world_size=2"], "ddp"),
    "adam-fsdp2-full-2": ("Adam", ["target.kind=fsdp2", "target.world_size=2", "output.format=fsdp_full"], "fsdp2"),
    "adam-fsdp2-dcp-2": ("Adam", ["target.kind=fsdp2", "target.world_size=2", "output.format=dcp"], "fsdp2"),
    "adamw-fsdp2-2": ("AdamW", ["target.kind=fsdp2", "target.world_size=2"], "fsdp2"),
    "adamw-fsdp2-3": ("AdamW", ["target.kind=fsdp2", "target.world_size=3"], "fsdp2"),
    "adamw-orig_params-2": ("AdamW", ["target.world_size=2", "target.use_orig_params=true"], "fsdp1_orig"),
    "adamw-none": ("AdamW", ["target.kind=none", "target.world_size=1", "output.format=plain"], "none"),
    "adamw-ddp-2": ("AdamW", ["target.kind=ddp", "target.world_size=2"], "ddp"),
}


def _save_sources(root: str) -> None:
    """A user's FSDP1 job on 2 ranks, once per optimizer: 3 steps, then FSDP.optim_state_dict (FULL) saved on rank 0."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    for name, options in OPTIMIZERS.items():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FSDP(
                userlm.build(), auto_wrap_policy=ModuleWrapPolicy({userlm.MixerBlock}), device_id=torch.device("cpu")
            )
            optim = getattr(torch.optim, name)(model.parameters(), lr=1e-3, **options)
            # each rank its own data, as in training
            userlm.steps(model, optim, userlm.batches(10 * dist.get_rank(), SOURCE_STEPS))
            full = FSDP.optim_state_dict(model, optim)
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(root, f"{name}.pt"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The sources, and every case converted by the command (one process runs them all: see ``run_cli_cases``)."""
    root = tmp_path_factory.mktemp("resume")
    run_local_world(_save_sources, 2, (str(root),), timeout_s=TIMEOUT_S)
    cases = [
        ["model.factory=userlm:build", f"input.path={root / f'{optimizer}.pt'}", *target, f"output.path={root / case}"]
        for case, (optimizer, target, _) in CASES.items()
    ]
    for case, result in zip(CASES, run_cli_cases(cases, cwd=root, per_case_s=TIMEOUT_S, env=user_env())):
        assert result["code"] == 0, f"{case}: {result['stderr']}"
        assert "check resume     pass" in result["stdout"], f"{case}: {result['stdout']}"
    return root


def _storages(osd: dict[str, Any]) -> dict[int, set[Any]]:
    """Storage address -> the parameters (state keys) whose state tensors use it."""
    users: dict[int, set[Any]] = {}
    for key, entry in osd["state"].items():
        for value in entry.values() if isinstance(entry, dict) else []:
            if torch.is_tensor(value) and value.untyped_storage().nbytes():
                users.setdefault(value.untyped_storage().data_ptr(), set()).add(key)
    return users


def test_the_source_shares_its_step_tensors(converted: Path) -> None:
    """The precondition of everything below: PyTorch's FSDP1 FULL file holds one step per unit, shared,
    and torch.load keeps it."""
    for name in OPTIMIZERS:
        osd = torch.load(converted / f"{name}.pt", weights_only=True)
        shared = [keys for keys in _storages(osd).values() if len(keys) > 1]
        assert shared, f"{name}.pt: no storage is shared; the trap this file tests is not there"


def _output_files(directory: Path, tmp: Path) -> list[Path]:
    """Every torch file of an output; a DCP checkpoint as the one torch.save file PyTorch's dcp_to_torch_save makes of
    it."""
    if (directory / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        target = tmp / f"{directory.name}.pt"
        dcp_to_torch_save(directory / "dcp", target)
        return [target]
    return sorted(directory.glob("rank_*.pt")) or [directory / "optim.pt"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_two_parameters_share_a_storage_in_the_output(case: str, converted: Path, tmp_path: Path) -> None:
    for path in _output_files(converted / case, tmp_path):
        loaded = torch.load(path, weights_only=True)
        osd = loaded.get("optim", loaded)  # a DCP checkpoint holds the state under output.key
        assert osd["state"], f"{path}: no state"
        shared = {ptr: keys for ptr, keys in _storages(osd).items() if len(keys) > 1}
        assert not shared, f"{path}: parameters {sorted(map(str, next(iter(shared.values()))))} share one storage"


# ---------------------------------------------------------------------------
# the resuming job, in plain PyTorch
# ---------------------------------------------------------------------------


def _target_job(job: str) -> torch.nn.Module:
    """The model as the resuming job wraps it (untrained weights, the same on every rank and in the reference)."""
    torch.manual_seed(0)
    model = userlm.build()
    if job == "fsdp2":
        return userlm.fully_shard_blocks(model)
    if job == "fsdp1_orig":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    if job == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    return model


def _load(job: str, model: torch.nn.Module, optim: torch.optim.Optimizer, out: Path) -> None:
    """The output into the job's optimizer, the way the README says for its format."""
    import osdpipe

    rank = dist.get_rank() if dist.is_initialized() else 0
    if (out / f"rank_{rank}.pt").exists():
        osdpipe.load_rank_local(optim, out / f"rank_{rank}.pt", model=model)
    elif (out / "dcp").is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        sd = {"optim": get_optimizer_state_dict(model, optim)}
        dcp.load(sd, checkpoint_id=str(out / "dcp"))
        set_optimizer_state_dict(model, optim, sd["optim"])
    elif job == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            model,
            optim,
            torch.load(out / "optim.pt", weights_only=True),
            options=StateDictOptions(full_state_dict=True),
        )
    else:
        optim.load_state_dict(torch.load(out / "optim.pt", weights_only=True))


def _full_state(
    job: str, model: torch.nn.Module, optim: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The job's optimizer state (FQN keyed) and parameters, gathered whole."""
    if job == "fsdp2":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        return get_optimizer_state_dict(model, optim, options=options), get_model_state_dict(model, options=options)
    if job == "fsdp1_orig":
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with warnings.catch_warnings(), FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(offload_to_cpu=False),  # offloading on CPU overwrites exp_avg
        ):
            warnings.simplefilter("ignore")
            return FSDP.optim_state_dict(model, optim), model.state_dict()
    module = model.module if job == "ddp" else model
    return userlm.fqn_keyed(module, optim), module.state_dict()


def _reference(optimizer: str, source: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The unwrapped model that loaded the source state, every tensor its own, and took the same steps."""
    torch.manual_seed(0)
    model = userlm.build()
    optim = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-3)
    full = torch.load(source, weights_only=True)
    names = [n for n, _ in model.named_parameters()]
    state = {names.index(fqn): {k: v.clone() for k, v in s.items()} for fqn, s in full["state"].items()}
    groups = [{**g, "params": [names.index(f) for f in g["params"]]} for g in full["param_groups"]]
    optim.load_state_dict({"state": state, "param_groups": groups})
    userlm.steps(model, optim, userlm.batches(100, RESUME_STEPS))
    return userlm.fqn_keyed(model, optim), model.state_dict()


def _resume(cases: list[str], root: str) -> dict[str, list[str]]:
    """On every rank of the world: each case's resuming job loads, trains, and is held against the reference."""
    problems: dict[str, list[str]] = {}
    for case in cases:
        optimizer, _, job = CASES[case]
        model = _target_job(job)
        optim = getattr(torch.optim, optimizer)(model.parameters(), lr=1.0)  # any lr: loading sets the checkpoint's
        _load(job, model, optim, Path(root) / case)
        groups = optim.param_groups
        problems[case] = (
            [] if groups[0]["lr"] == 1e-3 else [f"lr is {groups[0]['lr']} after loading, the source's is 0.001"]
        )
        if optimizer == "AdamW" and not (groups[0]["decoupled_weight_decay"] and groups[0]["weight_decay"] == 0.1):
            problems[case].append(f"the loaded param groups are not AdamW's: {groups[0]}")
        userlm.steps(model, optim, userlm.batches(100, RESUME_STEPS))
        state, params = _full_state(job, model, optim)
        problems[case] += _differences(
            state, params, *_reference(optimizer, Path(root) / f"{optimizer}.pt"), Path(root) / f"{optimizer}.pt"
        )
    return problems


def _differences(
    state: dict[str, Any],
    params: dict[str, torch.Tensor],
    ref_state: dict[str, Any],
    ref_params: dict[str, torch.Tensor],
    source: Path,
) -> list[str]:
    source_state = torch.load(source, weights_only=True)["state"]
    out = []
    for fqn, want in ref_state["state"].items():
        got = state["state"].get(fqn)
        if got is None:
            out.append(f"{fqn}: no state after resuming")
            continue
        expected_step = float(source_state[fqn]["step"]) + RESUME_STEPS
        if float(got["step"]) != expected_step or float(want["step"]) != expected_step:
            out.append(
                f"{fqn}: step {float(got['step'])} after {RESUME_STEPS} steps from {float(source_state[fqn]['step'])},"
                f" expected {expected_step}"
            )
        # averaging identical gradients over 3 ranks rounds: to within 1e-4 of the largest element
        for name in ("exp_avg", "exp_avg_sq"):
            if not torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-4 * float(want[name].abs().max())):
                out.append(
                    f"{fqn}.{name}: differs from the unwrapped reference by"
                    f" {float((got[name] - want[name]).abs().max())}"
                )
    for fqn, want in ref_params.items():
        if not torch.allclose(params[fqn], want, rtol=1e-5, atol=1e-7):
            out.append(
                f"parameter {fqn}: differs from the unwrapped reference by {float((params[fqn] - want).abs().max())}"
            )
    return out


def test_the_resuming_job_trains_as_it_would_have_from_the_source(converted: Path) -> None:
    by_world: dict[int, list[str]] = {}
    for case, (_, target, job) in CASES.items():
        if job != "none":
            world = int(next(a for a in target if a.startswith("target.world_size=")).split("=")[1])
            by_world.setdefault(world, []).append(case)
    problems: dict[str, list[str]] = {}
    for world, cases in sorted(by_world.items()):
        for rank, found in enumerate(run_local_world(_resume, world, (cases, str(converted)), timeout_s=TIMEOUT_S)):
            problems.update({f"{case} rank {rank}": p for case, p in found.items()})
    problems.update(_resume([c for c, (_, _, job) in CASES.items() if job == "none"], str(converted)))
    assert all(not p for p in problems.values()), {k: v for k, v in problems.items() if v}


# ---------------------------------------------------------------------------
# the check fails where the sharing is put back
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_resume_fails_naming_the_parameter_and_both_step_values_when_the_output_shares_a_step(
    mode: str, converted: Path, tmp_path: Path
) -> None:
    """With the copy undone (tests/support/faults/sitecustomize.py), the output shares the source's step tensors; resume
    must say so."""
    env = user_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "faults"), env["PYTHONPATH"]])
    env["OSDPIPE_TEST_SHARE_SCALARS"] = "1"
    args = [
        "model.factory=userlm:build", f"input.path={converted / 'Adam.pt'}",
        "target.kind=fsdp2", "target.world_size=2", f"runtime.mode={mode}",
    ]
    [result] = run_cli_cases([[*args, f"output.path={tmp_path / 'out'}"]], cwd=tmp_path, per_case_s=TIMEOUT_S, env=env)
    assert result["code"] == 1, result
    line = result["stderr"]
    assert "check resume: rank 0: " in line, line
    # A parameter by name, the step it reached, the source's, and the one a resuming job has.
    found = re.search(
        r"(embed\.weight|blocks\.\d\.\w+\.weight): step is (\d+\.0) after 2 step\(s\) from the source's 3\.0; "
        r"a job resuming from the source has 5\.0",
        line,
    )
    assert found and found.group(2) != "5.0", line
    assert "share memory" in line, line
    assert not (tmp_path / "out" / "rank_0.pt").exists(), "a conversion that failed resume is not written"
    # report.json's error is the line the command printed
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert line == f"osdpipe: error: {report['error']} (report: {tmp_path / 'out' / 'report.json'})\n", (
        line, report["error"]
    )


def test_an_optimizer_not_known_to_be_elementwise_is_stepped_whole_or_said_skipped(tmp_path: Path) -> None:
    """A user's own optimizer (tests/support/useroptim.py): its reference steps the whole model, so it runs under
    full_state_checks_max only, unless its class says it is elementwise; pipeline.resume_steps sets how many steps."""
    base = ["optim.kwargs.beta=0.8", "target.world_size=3"]
    cases = [
        [*base, "optim.name=useroptim:SignMomentum", "pipeline.resume_steps=3", f"output.path={tmp_path / 'whole'}"],
        [
            *base, "optim.name=useroptim:SignMomentum", "pipeline.full_state_checks_max=1KB",
            f"output.path={tmp_path / 'over'}",
        ],
        [
            *base, "optim.name=useroptim:ElementwiseSignMomentum", "pipeline.full_state_checks_max=1KB",
            f"output.path={tmp_path / 'says'}",
        ],
    ]
    whole, over, says = run_cli_cases(cases, cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    assert whole["code"] == 0 and (
        "check resume     pass  storage: no two state tensors share memory; "
        "steps: the fsdp1 target job loaded it and took 3 step(s)"
    ) in whole["stdout"], whole
    # osdpipe_elementwise = True
    assert says["code"] == 0 and "took 2 step(s)" in says["stdout"] and "storage part only" not in says["stderr"], says
    assert over["code"] == 0, over["stderr"]
    said = (
        "its steps need a reference over the whole model for SignMomentum,"
        " which osdpipe does not know to be elementwise"
    )
    assert f"osdpipe: warning: verify's resume check ran its storage part only: {said}" in over["stderr"], (
        over["stderr"]
    )
    resume = next(
        c for c in json.loads((tmp_path / "over" / "report.json").read_text())["checks"] if c["name"] == "resume"
    )
    assert (
        resume["ok"]
        and "steps not run: they need a reference over the whole model for SignMomentum" in resume["detail"]
    ), resume


def test_resume_steps_a_batch_whose_tensors_hold_no_element_on_the_rank(tmp_path: Path) -> None:
    """Under runtime.memory_budget the steps run a batch at a time; a batch of tensors that are all empty on this rank
    (usermodel's small parameters, use_orig_params on 2 ranks) compares nothing, where it used to build an optimizer of
    no tensors and fail."""
    import usermodel

    source = usermodel.save_stepped(tmp_path / "optim.pt", dim=30)
    args = ["model.factory=usermodel:make", "model.kwargs.dim=30", f"input.path={source}",
            "input.format=fsdp_full", "source.world_size=1", "target.world_size=2", "target.use_orig_params=true",
            "runtime.mode=offline", "pipeline.checks=[resume]"]  # fmt: skip
    budget, whole = run_cli_cases([[*args, "runtime.memory_budget=4KB", f"output.path={tmp_path / 'budget'}"],
                                   [*args, f"output.path={tmp_path / 'whole'}"]],
                                  cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())  # fmt: skip
    for result in (budget, whole):
        assert result["code"] == 0 and "check resume     pass" in result["stdout"], result["stderr"]


def test_without_a_budget_a_batch_of_bare_optimizers_holds_at_most_the_largest_tensors_state() -> None:
    """Offline, the resume check clones and steps a batch of the output's tensors beside the output: without
    ``runtime.memory_budget`` a batch is as large as the largest tensor's state, not the rank's whole (a second copy of
    it), and small tensors still share one; with a budget, as large as it says."""
    from osdpipe.verify.resume_training import in_batches, state_bytes

    def held(n: int) -> dict:
        return {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n), "step": torch.tensor(1.0)}

    tensors = [("a", held(100)), ("b", held(10)), ("c", held(30)), ("d", held(60)), ("e", held(100))]
    sizes = [state_bytes(state) for _, state in tensors]
    assert sizes == [800, 80, 240, 480, 800]  # the step counter is no tensor state

    def names(limit: int | None) -> list[list[str]]:
        return [[name for name, _ in b] for b in in_batches(tensors, sizes, limit)]

    assert names(None) == [["a"], ["b", "c", "d"], ["e"]]
    assert names(1 << 30) == [["a", "b", "c", "d", "e"]]
    assert names(1) == [["a"], ["b"], ["c"], ["d"], ["e"]]


def _hashes_counted(monkeypatch) -> list[tuple[str, int, int]]:
    """Every ``(key, start, stop)`` the synthetic hash computes from now on (osdpipe.layout.synthetic), in order."""
    from osdpipe.layout import synthetic

    hashed: list[tuple[str, int, int]] = []
    real = synthetic._hashed

    def counted(key: str, start: int, stop: int):
        hashed.append((key, start, stop))
        return real(key, start, stop)

    monkeypatch.setattr(synthetic, "_hashed", counted)
    return hashed


def test_offline_each_synthetic_range_is_computed_once_for_the_output_and_its_reference(monkeypatch, tmp_path) -> None:
    """Offline, the bare target and the reference start the same ranges from the same synthetic parameters and step
    them on the same synthetic gradients: each range is hashed once for both (osdpipe.run.live_jobs.
    each_computed_twice), where it was hashed once a side (under a budget, what half of it holds); and one element of
    the output off still fails the check."""
    import usermodel
    from helpers import planned

    from osdpipe.pipeline.execute import run_offline
    from osdpipe.pipeline.stages import STAGES
    from osdpipe.run import live_jobs
    from osdpipe.run.progress import Display
    from osdpipe.spec.reconcile import settle_and_validate

    source = usermodel.save_stepped(tmp_path / "optim.pt", dim=30)
    hashed = _hashes_counted(monkeypatch)

    def converted(out: str, budget: str | None) -> Any:
        hashed.clear()
        spec = settle_and_validate({
            "model": {"factory": "usermodel:make", "kwargs": {"dim": 30}},
            "source": {"world_size": 1}, "target": {"kind": "fsdp2", "world_size": 2},
            "input": {"path": str(source), "format": "fsdp_full"}, "output": {"path": str(tmp_path / out)},
            "pipeline": {"checks": ["resume"], "resume_steps": 2},
            "runtime": {"mode": "offline", "progress": False, "memory_budget": budget},
        })  # fmt: skip
        return run_offline(planned(spec), Display(False))

    most_held = []
    keep = live_jobs.Pairs.keep

    def keep_and_count(pairs, asked, out):
        keep(pairs, asked, out)
        most_held.append(pairs.held)

    monkeypatch.setattr(live_jobs.Pairs, "keep", keep_and_count)
    for out, budget in (("whole", None), ("budget", "1MB"), ("small_budget", "4KB")):
        most_held.clear()
        report = converted(out, budget)
        assert report.ok, report.checks
        grads = [h for h in hashed if h[0].startswith("grad\0")]
        assert grads and {h[0].split("\0")[2] for h in grads} == {"20000", "20001"}  # both resume steps
        twice = sorted(h for h in set(hashed) if hashed.count(h) > 1)
        if budget == "4KB":  # half of it holds no tensor's values: kept within it, the rest computed again
            assert twice and 0 < max(most_held) <= 2048, (twice, max(most_held, default=0))
        else:
            assert not twice, twice[:3]

    rekey = STAGES["rekey"]

    def rekey_then_spoil_rank_1(ctx, sharded, tally):
        keyed = rekey(ctx, sharded, tally)
        if ctx.rank == 1:
            next(iter(keyed.state_dict["state"].values()))["exp_avg"].view(-1)[0] += 1
        return keyed

    monkeypatch.setitem(STAGES, "rekey", rekey_then_spoil_rank_1)
    report = converted("spoiled", None)
    assert not report.ok and "differ from a job resuming from the source" in report.checks[0].detail, report.checks


def test_within_each_computed_twice_the_second_asking_is_the_firsts_copy_computed_once(monkeypatch) -> None:
    """The resume check's two sides ask for the same ranges: inside ``each_computed_twice`` the second asking gets the
    first computation's bits without hashing again, as a tensor of its own (the first asker stepping its tensor in
    place does not reach it), and is not kept for a third; what ``limit`` cannot hold is computed again; outside,
    nothing is kept."""
    from osdpipe.layout import synthetic
    from osdpipe.run import live_jobs

    hashed = _hashes_counted(monkeypatch)
    grad, param = synthetic.grad_key(0, 1, "w"), synthetic.param_key(0, "w")
    want = live_jobs.synthetic_grad(0, 1, "w", 10, 1010, torch.float32)
    with live_jobs.each_computed_twice(limit=1000 * 4) as pairs:
        first = live_jobs.synthetic_grad(0, 1, "w", 10, 1010, torch.float32)
        first.mul_(3)  # stepped in place by the side that asked first
        second = live_jobs.synthetic_grad(0, 1, "w", 10, 1010, torch.float32)
        assert torch.equal(second.view(torch.int32), want.view(torch.int32))
        third = live_jobs.synthetic_grad(0, 1, "w", 10, 1010, torch.float32)  # taken once: computed again
        assert torch.equal(third, want)
        assert pairs.held == 4000  # the third's copy, kept for an asking that does not come
        live_jobs.synthetic_param(0, "w", 0, 1, torch.float32)  # over the limit: not kept
        live_jobs.synthetic_param(0, "w", 0, 1, torch.float32)
        pairs.clear()
        assert pairs.held == 0
    assert hashed.count((grad, 10, 1010)) == 3  # before, the first, the third: never the second
    assert hashed.count((param, 0, 1)) == 2
    live_jobs.synthetic_param(0, "w", 0, 5, torch.float32)
    live_jobs.synthetic_param(0, "w", 0, 5, torch.float32)
    assert hashed.count((param, 0, 5)) == 2 and live_jobs._pairs is None
