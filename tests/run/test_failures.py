"""Failures end every rank with one error naming the stage and the ranks; nothing hangs, nothing is left behind."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch.distributed as dist
from helpers import planned

from osdpipe.pipeline.loop import run_stages
from osdpipe.pipeline.stages import STAGES
from osdpipe.run.collective import StageError
from osdpipe.run.launch import WorldError, run_local_world
from osdpipe.run.world import GroupWorld
from osdpipe.spec.config import PipelineConfig
from osdpipe.spec.reconcile import settle_and_validate


def _rank1_raises_rank0_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 1 never arrives


def test_world_ends_when_one_rank_fails():
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_local_world(_rank1_raises_rank0_waits, 2, timeout_s=60)
    assert time.monotonic() - start < 30, "the launcher waited for the collective timeout instead of ending the world"
    assert 1 in info.value.failures  # rank 0 may also fail, its barrier broken by rank 1's exit
    assert "boom on rank 1" in str(info.value)
    assert not multiprocessing.active_children(), "a rank process was left behind"


def _explode(ctx, product, tally):
    if ctx.rank == 1:
        raise RuntimeError("disk full on rank 1")
    return product  # passed on to the next stage


def _run_with_exploding_stage(spec) -> str:
    STAGES.setdefault("explode", _explode)
    try:
        run_stages(planned(spec), GroupWorld())
    except StageError as exc:
        return str(exc)
    return "no error"


def _make_source(spec) -> str:
    from osdpipe.run.generate import generate_rank

    return generate_rank(planned(spec))


def test_stage_error_is_raised_on_every_rank(tmp_path):
    spec = settle_and_validate({"output": {"path": str(tmp_path)}, "runtime": {"timeout_s": 60}})
    source = run_local_world(_make_source, 2, (spec,), timeout_s=120)[0]
    stages = ["load", "broadcast", "explode", "flatten", "shard", "rekey", "save"]
    spec = settle_and_validate(
        {"output": {"path": str(tmp_path / "out")}, "input": {"path": source}, "runtime": {"timeout_s": 60}}
    )
    spec = spec.model_copy(update={"pipeline": PipelineConfig.model_construct(stages=stages, checks=[])})
    messages = run_local_world(_run_with_exploding_stage, 2, (spec,), timeout_s=120)
    assert messages[0] == messages[1], messages
    assert "stage 'explode' failed on rank 1:" in messages[0] and "disk full on rank 1" in messages[0]
    assert not (tmp_path / "out" / "rank_0.pt").exists(), "a later stage ran after a failed one"


def _unpicklable_result():
    return {}.keys()


def test_unpicklable_result_is_an_error_not_a_hang():
    start = time.monotonic()
    with pytest.raises(WorldError, match="cannot be pickled"):
        run_local_world(_unpicklable_result, 2, timeout_s=60)
    assert time.monotonic() - start < 30


def _stage_fails_on_rank0_only(spec) -> None:
    """Rank 0 fails in a stage; every rank raises the agreed StageError out of the worker."""
    STAGES.setdefault("explode0", _explode_on_rank0)
    run_stages(planned(spec), GroupWorld())


def _explode_on_rank0(ctx, product, tally) -> None:
    if ctx.rank == 0:
        raise ValueError("cannot read /ckpt/optim.pt: it is truncated")


def test_a_stage_error_is_reported_once_not_as_every_ranks_failure(tmp_path):
    """Each rank raises the same agreed error; the world reports it once, not 'rank 2 failed: ...
    (also failed: ...)'."""
    (tmp_path / "optim.pt").write_bytes(b"")  # never read: the only stage raises first
    spec = settle_and_validate(
        {
            "output": {"path": str(tmp_path / "out")},
            "input": {"path": str(tmp_path / "optim.pt")},
            "runtime": {"timeout_s": 60},
        }
    )
    spec = spec.model_copy(update={"pipeline": PipelineConfig.model_construct(stages=["explode0"], checks=[])})
    with pytest.raises(WorldError) as info:
        run_local_world(_stage_fails_on_rank0_only, 3, (spec,), timeout_s=120)
    assert str(info.value) == "stage 'explode0' failed on rank 0: cannot read /ckpt/optim.pt: it is truncated"


def test_echoes_of_a_failure_are_not_failures_of_their_own():
    from osdpipe.run.launch import RankFailure, world_error

    failures = {
        1: RankFailure(
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer", ""
        ),
        0: RankFailure("disk full on rank 0", "tb0"),
        2: RankFailure("RuntimeError: Connection reset by peer", ""),
    }
    error = world_error(failures)
    assert str(error) == "rank 0 failed: disk full on rank 0"
    assert error.traceback == "tb0"


def test_a_rank_that_dies_without_a_word_is_described_by_its_exit_and_stage():
    from osdpipe.run.launch import death

    assert death(-9, "save").startswith(
        "process killed by SIGKILL in stage 'save' without reporting an error; the kernel's out-of-memory killer"
    )
    assert death(-11, "shard") == "process killed by SIGSEGV in stage 'shard' without reporting an error"
    assert death(3, None) == "process exited with code 3 before its first stage without reporting an error"
    assert death(-200, "load") == "process killed by signal 200 in stage 'load' without reporting an error"


def _post_and_die(stage: str) -> None:
    import os

    from osdpipe.run import whereabouts

    whereabouts.enter("load")
    whereabouts.enter(stage)
    if dist.get_rank() == 1:
        os._exit(3)  # no exception, no report: only the exit code and the board tell
    dist.barrier()


def test_the_launcher_names_the_stage_a_silent_death_happened_in():
    with pytest.raises(WorldError) as info:
        run_local_world(_post_and_die, 2, ("a-stage-name-longer-than-the-board-cell-holds",), timeout_s=60)
    assert (
        "rank 1 failed: process exited with code 3 in stage 'a-stage-name-longer-than-the-boa'"
        " without reporting an error" == str(info.value)
    )
    assert not multiprocessing.active_children()
