"""The Python API inside a live job: each rank's own optimizer, even one built in another parameter order."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import osdpipe
from osdpipe.core.compare import diff
from osdpipe.io.loading import without_records
from osdpipe.layout import kinds
from osdpipe.layout.kinds import rank_layout
from osdpipe.layout.models import build_model
from osdpipe.layout.tree import describe
from osdpipe.run.launch import WorldError, run_local_world
from osdpipe.run.live_jobs import train_step
from osdpipe.spec.reconcile import settle_and_validate

TIMEOUT_S = 120
MODEL = {"factory": "nested", "kwargs": {"dim": 8, "hidden": 12, "blocks": 2}}
SOURCE = {"world_size": 2, "wrap": ["Block"]}
TARGET = {"world_size": 2, "wrap": ["Leaf"], "use_orig_params": True}


def _generate(spec) -> str:
    from osdpipe.run.generate import generate_rank
    from osdpipe.spec.plan import plan_run

    return generate_rank(plan_run(spec))


@pytest.fixture(scope="module")
def source_checkpoint(tmp_path_factory) -> str:
    spec = settle_and_validate(
        {"model": MODEL, "source": SOURCE, "output": {"path": str(tmp_path_factory.mktemp("api_source"))}}
    )
    return run_local_world(_generate, 2, (spec,), timeout_s=TIMEOUT_S)[0]


def _resume(checkpoint: str, target: dict) -> list[str]:
    """A training script resuming on another layout: odd ranks build their optimizer from the reversed parameters."""
    from osdpipe.layout.ranges import LayoutSpec

    spec = LayoutSpec(kind="fsdp1", world_size=2, wrap=("Leaf",), use_orig_params=True)
    model = kinds.get("fsdp1").wrap(build_model("nested", MODEL["kwargs"], seed=0), spec)
    params = list(model.parameters())
    if dist.get_rank() % 2:
        params = params[::-1]
    optim = torch.optim.Adam(params, lr=0.01)
    state = osdpipe.load_optimizer_state(model, optim, checkpoint, model_config=MODEL, source=SOURCE, target=target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = kinds.get("fsdp1").to_load(model, optim, torch.load(checkpoint, weights_only=True))
    problems = diff(without_records(state), expected)
    # The state must be keyed so that each ID's tensor sits on the parameter of that position in *this* optimizer.
    for pid, p in enumerate(optim.param_groups[0]["params"]):
        if pid in optim.state_dict()["state"] and optim.state_dict()["state"][pid]["exp_avg"].shape != p.shape:
            problems.append(
                f"ID {pid}: state of shape {tuple(optim.state_dict()['state'][pid]['exp_avg'].shape)}"
                f" on a parameter of shape {tuple(p.shape)}"
            )
    tree = describe(build_model("nested", MODEL["kwargs"], device="meta"))
    train_step(
        settle_and_validate({"model": MODEL, "output": {"path": checkpoint + ".unused"}}),
        model,
        optim,
        7,
        rank_layout(tree, spec, dist.get_rank()),
        tree,
    )
    return problems


def test_api_loads_into_each_ranks_own_optimizer(source_checkpoint):
    per_rank = run_local_world(_resume, 2, (source_checkpoint, TARGET), timeout_s=TIMEOUT_S)
    assert per_rank == [[], []], per_rank


def test_api_refuses_a_model_of_another_layout(source_checkpoint):
    wrong = {**TARGET, "wrap": ["Block"]}  # the live model is wrapped with Leaf units
    with pytest.raises(WorldError) as info:
        run_local_world(_resume, 2, (source_checkpoint, wrong), timeout_s=TIMEOUT_S)
    assert "does not have the expected layout" in str(info.value)


def test_api_needs_a_process_group(source_checkpoint):
    model = build_model("nested", MODEL["kwargs"])
    with pytest.raises(RuntimeError, match="initialized process group"):
        osdpipe.reshard_optimizer_state(
            model,
            torch.optim.Adam(model.parameters()),
            source_checkpoint,
            model_config=MODEL,
            source=SOURCE,
            target=TARGET,
        )


def _resume_check_batches(checkpoint: str) -> tuple[list[int], int]:
    """The resume check in a live job (the API's own model and optimizer: a live target): how many ranges each call
    to its reference stepped, and how many the rank's tensors hold."""
    from osdpipe.layout.ranges import LayoutSpec
    from osdpipe.verify import resume_training

    asked: list[int] = []
    pieces = resume_training.Reference.pieces

    def counted(self, ranges, device=None):
        asked.append(len(ranges))
        return pieces(self, ranges, device)

    resume_training.Reference.pieces = counted
    spec = LayoutSpec(kind="fsdp1", world_size=2, wrap=("Leaf",), use_orig_params=True)
    model = kinds.get("fsdp1").wrap(build_model("nested", MODEL["kwargs"], seed=0), spec)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    osdpipe.reshard_optimizer_state(model, optim, checkpoint, model_config=MODEL, source=SOURCE, target=TARGET,
                                    checks=["resume"])  # fmt: skip
    tree = describe(build_model("nested", MODEL["kwargs"], device="meta"))
    held = sum(len(resume_training.pieces_of(t)) for t in rank_layout(tree, spec, dist.get_rank()) if t.stepped)
    return asked, held


def test_a_live_target_is_compared_with_its_reference_a_batch_at_a_time(source_checkpoint):
    """The resume check's reference steps the ranges of one batch of the live target's tensors at a time (each at
    most the largest tensor's state without a budget), every range once: it never holds the rank's whole state
    stepped from the source beside the live job's."""
    for asked, held in run_local_world(_resume_check_batches, 2, (source_checkpoint,), timeout_s=TIMEOUT_S):
        assert len(asked) > 1 and sum(asked) == held, (asked, held)
