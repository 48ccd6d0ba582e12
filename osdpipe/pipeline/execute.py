"""Run the stages on every rank, time them, and report.

:func:`execute` is the whole conversion as the CLI runs it, from the plan the
launcher built once (:mod:`osdpipe.spec.plan`): generate a source when none is
given, run the pipeline on the target world, write ``report.json``.
:func:`run_rank` is the per-rank part, shared by the local world, torchrun
and the Python API; :func:`run_offline` plays every rank in one process,
:func:`run_share` a worker's share of them beside other workers. All run the
one stage loop of :mod:`osdpipe.pipeline.loop`.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from traceback import format_exc

import torch.distributed as dist

from osdpipe.core.rankserver import joins_torchrun
from osdpipe.io import output
from osdpipe.io.formats import InputError
from osdpipe.io.output import OutputError
from osdpipe.layout.optim import group_members
from osdpipe.layout.ranges import full_layout
from osdpipe.pipeline import loop
from osdpipe.run import progress, whereabouts
from osdpipe.run.collective import StageError, agree, from_rank0, lost_a_peer, one_line
from osdpipe.run.generate import generate_rank
from osdpipe.run.launch import WorldError, backend_for, init_world, run_local_world
from osdpipe.run.logfile import write_log
from osdpipe.run.products import Sharded
from osdpipe.run.report import Report
from osdpipe.run.stages.load import inspect_input
from osdpipe.run.world import GroupWorld, ShareWorld, SoloWorld, worker_named
from osdpipe.spec.config import RunSpec
from osdpipe.spec.plan import Plan


def run_rank(plan: Plan) -> Report:
    """The pipeline on this rank of an initialized target world (or alone, without one);
    every rank gets the same report."""
    return loop.run_stages(plan, GroupWorld())[0]


def run_offline(plan: Plan, display: progress.Display | None = None) -> Report:
    """Every target rank in turn in this process, with no process group (``runtime.mode=offline``).

    A layout needs only the module tree of a ``meta`` model, the wrapping and
    the world size, so one process can play each of the target's ranks (see
    :class:`~osdpipe.run.world.SoloWorld`); memory holds one target rank's output
    at a time, and the files are committed once, after the last rank.
    """
    world = SoloWorld(plan.world_size)
    if display is not None:
        display.phase(f"offline: {world.size} target rank(s)", unit="B")
    weights = rank_weights(plan)
    return loop.run_stages(plan, world, on_rank=_share_done(0, weights, world.ranks(), display), display=display)[0]


def run_share(plan: Plan) -> Report:
    """This worker's share of the target's ranks,
    beside the other workers of the process group (``runtime.workers``, torchrun offline).

    Each worker reads what its ranks need and stages their files; the one
    playing rank 0 commits once every worker has staged (see
    :class:`~osdpipe.run.world.ShareWorld`). Its progress is its share's bytes.
    """
    weights = rank_weights(plan)
    world = ShareWorld(plan.world_size, weights)
    return loop.run_stages(plan, world, on_rank=_share_done(world.worker, weights, world.ranks()))[0]


def rank_weights(plan: Plan) -> list[int]:
    """What each target rank holds, in elements of its optimizer's state:
    the measure a worker's share is balanced by."""
    return [sum(t.numel for t in plan.target_layout(rank)) for rank in range(plan.world_size)]


def _share_done(
    worker: int, weights: list[int], ranks: Sequence[int], display: progress.Display | None = None
) -> Callable[[loop.Played], None]:
    """After each rank a worker plays: its share's bytes written so far,
    and their total (extrapolated from the bytes per element so far).

    Sent as a ``share`` progress event, which the display sums over workers
    (drawn on ``display`` where the worker draws its own).
    """
    share = sum(weights[r] for r in ranks)
    done = {"bytes": 0, "elements": 0}
    draw = progress.drawer(display)

    def after(played: loop.Played) -> None:
        sharded = played.find(Sharded)
        done["bytes"] += 0 if sharded is None else sharded.state_bytes()
        done["elements"] += weights[played.ctx.rank]
        total = done["bytes"] * share // done["elements"] if done["elements"] else (None if share else 0)
        draw(("share", worker, done["bytes"], total))

    return after


def _convert_worker(plan: Plan) -> Report | None:
    report = run_rank(plan)
    return report if dist.get_rank() == 0 else None


def _share_worker(plan: Plan) -> Report | None:
    report = run_share(plan)
    return report if dist.get_rank() == 0 else None


def check_source(plan: Plan) -> None:
    """Read the input's metadata and check it against the model and the source layout, in this process.

    What the load and broadcast stages would find wrong with the input (a
    damaged file, a missing rank file, another model's checkpoint, state that
    does not fit the source layout) is found here, before any process starts.

    Raises:
        InputError: naming the file and what is wrong with it.
    """
    spec = plan.spec
    meta = inspect_input(plan)
    if meta.param_groups is not None:  # the source's optimizer held these; the target's must find each of its own there
        layout = full_layout(plan.tree)
        held = {f for g in group_members(spec.optim, layout) for i in g for f in layout[i].fqns}
        missing = sorted(held - {f for g in meta.param_groups for f in g["params"]})
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise InputError(
                f"{plan.input_path}: the source's optimizer does not hold {shown}, which the model has; "
                "is model.factory / model.kwargs the model that saved it (or optim.param_groups its grouping)?"
            )


def execute(plan: Plan, warnings: Sequence[str] = (), source_checked: bool = False) -> Report:
    """The whole conversion in a local world (spawned ranks) or in the current torchrun world.

    The output directory is prepared first (:func:`osdpipe.io.output.begin`); a
    failed run leaves it as it was, but for ``report.json``, which it always
    writes. ``warnings`` (what settling the config found, see
    :mod:`osdpipe.spec.reconcile`) open the report's warnings. ``source_checked``: the caller ran
    :func:`check_source` already (the command does, so that an input that does not fit is refused before anything
    is written); else it runs here, and a failure is the report's.

    Raises:
        OutputError: ``output.path`` cannot be written, so not even a report can be.
    """
    spec = plan.spec
    backend = None if spec.runtime.backend == "auto" else spec.runtime.backend
    if joins_torchrun(spec.runtime.launcher):
        return _execute_torchrun(plan, backend, warnings)
    out = Path(spec.output.path)
    _begin(out, spec)
    display = progress.Display(progress.wanted(spec.runtime.progress))
    try:
        report = _execute_local(plan, backend, display, source_checked)
    except (WorldError, StageError) as exc:
        report = Report(ok=False, error=str(exc), traceback=getattr(exc, "traceback", None) or None)
    except ValueError as exc:  # the input (InputError) or what the config says of it, found before any process starts
        report = Report(ok=False, error=one_line(exc), traceback=format_exc())
    finally:
        display.close()
    report.warnings[:0] = warnings
    output.abort(out)  # whatever a failed (or save-less) run staged
    record(out, report, spec)
    return report


def _execute_local(plan: Plan, backend: str | None, display: progress.Display, source_checked: bool) -> Report:
    """Check the input (unless ``source_checked``), generate a source when none is given, convert on a local world of
    spawned ranks (or offline)."""
    spec = plan.spec
    if spec.input.path is not None:
        if not source_checked:
            display.phase("checking the input")
            check_source(plan)
    else:
        display.phase(f"generating a source: {spec.generate.steps} steps on {spec.source.world_size} rank(s)")
        run_local_world(
            generate_rank,
            spec.source.world_size,
            (plan,),
            backend=backend,
            timeout_s=spec.runtime.timeout_s,
            display=display,
        )
    if spec.runtime.mode == "offline" and spec.runtime.workers == 1:
        return run_offline(plan, display)
    if spec.runtime.mode == "offline" and spec.runtime.workers < spec.target.world_size:
        display.phase(f"offline: {spec.target.world_size} target rank(s) on {spec.runtime.workers} workers", unit="B")
        return run_local_world(
            _share_worker,
            spec.runtime.workers,
            (plan,),
            backend=backend,
            timeout_s=spec.runtime.timeout_s,
            display=display,
            who=lambda worker: worker_named(worker, spec.runtime.workers),
            shared_progress=("share",),
        )[0]
    # online, or as many workers as target ranks: the target world itself, where the checks that need its job run
    display.phase(f"starting {spec.target.world_size} rank(s)")
    return run_local_world(
        _convert_worker,
        spec.target.world_size,
        (plan,),
        backend=backend,
        timeout_s=spec.runtime.timeout_s,
        display=display,
    )[0]


def _execute_torchrun(plan: Plan, backend: str | None, warnings: Sequence[str]) -> Report:
    """Join the torchrun world: the target world (and, to generate, the source world too),
    or offline, workers playing its ranks.

    Rank 0 prepares the output directory, draws progress and writes the report; for an output bound for object
    storage every process prepares its own (:func:`_each_makes_its_own`).
    """
    spec = plan.spec
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    out = Path(spec.output.path)
    display = progress.Display(rank == 0 and progress.wanted(spec.runtime.progress))
    progress.connect(display if rank == 0 else None)
    report: Report
    stop_on_sigterm = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if stop_on_sigterm else None
    whereabouts.enter("launch")
    try:
        offline = spec.runtime.mode == "offline"
        if offline and not 1 <= world <= spec.target.world_size:
            raise StageError(
                "launch",
                {
                    0: f"torchrun started {world} workers for target.world_size={spec.target.world_size}; "
                    f"each worker plays at least one target rank: start at most {spec.target.world_size}"
                },
            )
        if not offline and world != spec.target.world_size:
            raise StageError(
                "launch",
                {
                    0: f"torchrun started {world} ranks but target.world_size={spec.target.world_size}; "
                    "start as many ranks as the target has, "
                    f"or set runtime.mode=offline to play its ranks on these {world}"
                },
            )
        if spec.runtime.workers not in (1, world):
            raise StageError(
                "launch",
                {
                    0: f"runtime.workers={spec.runtime.workers} but torchrun started {world}; "
                    "under torchrun the workers are its world: leave runtime.workers out"
                },
            )
        if not dist.is_initialized():
            # torchrun says how many of its ranks run on this machine
            init_world(backend_for(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))), spec.runtime.timeout_s)
        try:
            if plan.upload is None:
                from_rank0("launch", lambda: _begin(out, spec))
            else:
                plan = _each_makes_its_own(plan, out, rank)
            if spec.input.path is None:
                if spec.source.world_size != world:
                    raise StageError(
                        "generate",
                        {
                            0: f"under torchrun, generating a source needs source.world_size == {world}; "
                            "give input.path instead"
                        },
                    )
                generate_rank(plan)
            # as many as the target's ranks: its world
            report = run_share(plan) if offline and world < spec.target.world_size else run_rank(plan)
        finally:
            dist.destroy_process_group()
            # What of gloo's a reference cycle still holds is otherwise freed
            # during interpreter shutdown, where a rank now and then aborts
            # ("terminate called without an active exception": 3 of 36 bare
            # gloo torchrun scripts, 0 of 104 with this collect).
            gc.collect()
    except StageError as exc:
        report = Report(ok=False, error=str(exc), traceback=format_exc())
    except Exception as exc:  # noqa: BLE001
        # this rank's own view: a collective another rank's death broke, or torchrun's stop
        failure = StageError(whereabouts.current() or "launch", {rank: _own_failure(exc)})
        report = Report(ok=False, error=str(failure), traceback=format_exc(), agreed=False)
    finally:
        if stop_on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the run is over: what it found is written, whoever stops it
        display.close()
        progress.connect(None)
    report.warnings[:0] = warnings
    try:
        if rank == 0 or not report.agreed or plan.upload is not None:
            # rank 0 does; a rank that lost the others does too, rank 0 may be the one lost; each its own directory
            output.abort(out)
        if rank == 0:
            record(out, report, spec)
    finally:
        if stop_on_sigterm:
            signal.signal(signal.SIGTERM, previous)
    return report


def _each_makes_its_own(plan: Plan, out: Path, rank: int) -> Plan:
    """An output bound for object storage under torchrun: the nodes share no directory, so each process prepares its
    own (``out``, :func:`osdpipe.cli.compose.made_in`), stages its ranks' files there and sends them as they are
    written; rank 0's directory takes the record and the files that finish the conversion. Rank 0 prepared the prefix:
    how files go into it (its :class:`~osdpipe.io.remote_output.Upload`), or why it could not, is taken from rank 0."""
    assert plan.upload is not None
    upload = from_rank0("launch", plan.upload.accepted)
    error = None
    try:
        if rank == 0:
            _begin(out, plan.spec)
        else:
            output.begin(out, plan.spec.output.fsync)
    except OutputError as exc:
        error = str(exc)
    agree("launch", error, rank=rank)
    return replace(plan, upload=upload)


def _begin(out: Path, spec: RunSpec) -> None:
    """Prepare the output directory (:func:`osdpipe.io.output.begin`), its report and log saying the run is under way.

    So a run that dies without a word (its launcher, or rank 0 under
    torchrun, killed) does not leave the previous run's report and log,
    which may say ``ok``, as if they were this one's.
    """
    output.begin(out, spec.output.fsync)
    record(out, Report.unfinished(), spec)


def record(out: Path, report: Report, spec: RunSpec) -> None:
    """What the run says of itself in the output directory:
    ``report.json`` and ``osdpipe.log``, each written whole (and synced)."""
    report.write(out, spec.output.fsync)
    write_log(out, report, spec)


class Stopped(Exception):
    """This rank was sent SIGTERM: under torchrun, because another rank failed (torchrun then stops them all)."""


def _raise_stopped(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Stopped("stopped by SIGTERM: torchrun stops every rank once one fails, and its summary names that rank")


def _own_failure(exc: BaseException) -> str:
    """A failure only this rank saw, in words: above all a collective that another rank's death broke."""
    text = str(exc) if isinstance(exc, Stopped) else one_line(exc)
    if lost_a_peer(text):
        return f"lost another rank in a collective: it died or failed (torchrun's summary names it); {text}"
    return text
