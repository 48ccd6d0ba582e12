"""Where the ranks come from: a local world of processes started here, or an existing torchrun world.

The same worker function runs in both. A local world picks a free port, starts
one process per rank (forked from the rank server, :mod:`osdpipe.core.rankserver`,
or spawned), and watches them: the first rank that fails ends the
world (the others are terminated, none is left behind) and its error is raised
in the launcher with the ranks that failed. The ranks' standard error is
theirs, not the terminal's (:mod:`osdpipe.run.native_crash`): a failed run
says one line.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from osdpipe.core import rankserver, vector_math
from osdpipe.io import remote_input
from osdpipe.run import native_crash, progress, whereabouts
from osdpipe.run.collective import StageError, lost_a_peer, one_line

#: How long the launcher waits for the other ranks to report after one failed.
GRACE_S = 5.0


class WorldError(RuntimeError):
    """Some ranks of a world failed; ``failures`` maps each failed rank to its error text.

    ``traceback`` is the failing rank's traceback (for ``runtime.debug``).
    """

    def __init__(self, failures: dict[int, str], summary: str, traceback: str = "") -> None:
        super().__init__(summary)
        self.failures = failures
        self.traceback = traceback


@dataclass(frozen=True)
class RankFailure:
    """What a failed rank sends back: the one-line message, and the traceback for the log.

    ``agreed``: the error is a :class:`~osdpipe.run.collective.StageError`, which
    every rank raises with the same text; it already names the failed ranks.
    """

    message: str
    traceback: str
    agreed: bool = False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(asked: str | None, local_ranks: int, gpus: int | None = None) -> str:
    """The process group's backend: ``asked`` (``runtime.backend``; ``None``: ``auto``), else NCCL where this machine
    has a GPU for each of its ``local_ranks`` ranks (NCCL runs one rank per GPU: two on one GPU fail in the first
    collective), gloo otherwise. ``gpus``: how many this machine has (``None``: as CUDA says).

    Raises:
        ValueError: NCCL asked for with fewer GPUs than ranks on this machine.
    """
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if asked is None:
        return "nccl" if gpus >= local_ranks else "gloo"
    if asked == "nccl" and gpus < local_ranks:
        raise ValueError(
            f"runtime.backend=nccl runs one rank per GPU, and this machine has {gpus} GPU(s) for {local_ranks} "
            "rank(s); set runtime.backend=gloo (or auto, which chooses it here), or start fewer ranks per machine"
        )
    return asked


def init_world(backend: str, timeout_s: float, rank: int | None = None, world_size: int | None = None) -> None:
    """Join the process group described by the environment (or by ``rank``/``world_size``)."""
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if rank is not None:
        kwargs.update(rank=rank, world_size=world_size)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank or 0)))
    dist.init_process_group(**kwargs)


def share_cores(local_ranks: int) -> None:
    """Give this rank its share of the cores this process may run on for torch's intra-op threads.

    Left alone, every rank's torch starts a thread per core: ``local_ranks``
    ranks on one machine oversubscribe it that many times over, and the
    copies and sums of ``shard`` and ``verify``, all memory-bound, run slower
    for it (1.6 GB, 4 -> 2 ranks on 2 cores: ``shard`` 0.67 s with two
    threads a rank, 0.50 s with one). torchrun sets ``OMP_NUM_THREADS=1`` for
    the same reason; a user's ``OMP_NUM_THREADS`` is left to rule.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_ranks))


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    events: Any,
    board: Any,
    shared_progress: tuple[str, ...],
    rank_files: str,
    seen: remote_input.Seen | None,
) -> None:
    native_crash.arm(native_crash.dump_path(Path(rank_files), rank))
    native_crash.capture_stderr(native_crash.stderr_path(Path(rank_files), rank))
    whereabouts.attach(board, rank)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    share_cores(world_size)
    vector_math.settle()  # before a rank's first float math, which checks compare bit for bit
    warnings.simplefilter("ignore")  # what a user must know travels in the report, not as Python warnings on stderr
    if events is not None and shared_progress:
        progress.connect(progress.only(shared_progress, events.put))
    elif rank == 0 and events is not None:
        progress.connect(events.put)
    try:
        init_world(backend, timeout_s, rank, world_size)
        with remote_input.one_snapshot(seen):  # the input as the command saw it: listed, its small reads fetched
            outcome = (rank, True, fn(*args))
    except StageError as exc:
        outcome = (rank, False, RankFailure(str(exc), traceback.format_exc(), agreed=True))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        outcome = (rank, False, RankFailure(one_line(exc), traceback.format_exc()))
    # Sent as plain pickle bytes: a result the queue cannot pickle would
    # otherwise vanish in its feeder thread and leave the launcher waiting,
    # and tensors would travel through shared-memory handles.
    try:
        payload = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001
        payload = pickle.dumps((rank, False, RankFailure(f"rank {rank}'s result cannot be pickled: {exc}", "")))
    # Report before tearing the group down: the teardown breaks the other
    # ranks' collectives, and their echo of it must not arrive first.
    results.put(payload)
    results.close()
    results.join_thread()
    if dist.is_initialized():
        if outcome[1]:
            # Rank 0 hosts the store the group was built on: a rank that
            # finished must not take it down while another still needs it.
            # A failed rank skips this; its teardown ends the others' wait.
            with contextlib.suppress(Exception):
                dist.barrier()
        dist.destroy_process_group()


def death(exitcode: int, stage: str | None, code: str | None = None, printed: str | None = None) -> str:
    """Why a rank process ended without a word, and where: "process killed by SIGKILL in stage 'save'";
    ``code``: the Python code it was in (:func:`osdpipe.run.native_crash.innermost`), where it said; ``printed``: the
    last line it wrote to standard error (:func:`osdpipe.run.native_crash.last_words`), which is what native code says
    as it aborts. Not for SIGKILL: a process cannot write as that signal ends it, so its last line is older news."""
    if exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    where = f"in stage {stage!r}" if stage else "before its first stage"
    at = f" (in {code})" if code else ""
    if printed and exitcode != -signal.SIGKILL:
        at += f"; it printed {printed!r}"
    hint = (
        "; the kernel's out-of-memory killer sends SIGKILL: see runtime.memory_budget"
        if exitcode == -signal.SIGKILL
        else ""
    )
    return f"process {how} {where} without reporting an error{at}{hint}"


def _dead_rank_record(dump: str, printed: str) -> str:
    """What the log and ``runtime.debug`` show of a rank that died without a word: its stacks, then its standard
    error."""
    parts = [dump.rstrip()] if dump.strip() else []
    if printed.strip():
        parts.append("standard error:\n" + printed.rstrip())
    return "\n\n".join(parts)


def _is_echo(failure: RankFailure) -> bool:
    """The error a rank's failure causes in the *other* ranks' collectives."""
    return lost_a_peer(failure.message)


def root_cause(failures: dict[int, RankFailure]) -> tuple[int, RankFailure]:
    """The failure that explains the others: the first one that is not a broken collective's echo."""
    for rank, failure in failures.items():
        if not _is_echo(failure):
            return rank, failure
    return next(iter(failures.items()))


def rank_named(rank: int) -> str:
    return f"rank {rank}"


def world_error(failures: dict[int, RankFailure], who: Callable[[int], str] = rank_named) -> WorldError:
    """One error for a failed world, saying each thing once.

    A stage error is the same text on every rank that raised it and already
    names the ranks where the stage failed: it is reported as it is. Otherwise
    the root cause is reported with its rank; ranks whose error only echoes it
    (a collective broken by the failed rank's exit) are not failures of their own.
    """
    agreed = [f for f in failures.values() if f.agreed]
    if agreed:
        return WorldError({r: f.message for r, f in failures.items()}, agreed[0].message, agreed[0].traceback)
    rank, cause = root_cause(failures)
    others = sorted(r for r, f in failures.items() if r != rank and not _is_echo(f) and not f.agreed)
    summary = f"{who(rank)} failed: {cause.message}" + (
        f" ({', '.join(map(who, others))} failed too)" if others else ""
    )
    return WorldError({r: f.message for r, f in failures.items()}, summary, cause.traceback)


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    backend: str | None = None,
    timeout_s: float = 300.0,
    display: progress.Display | None = None,
    who: Callable[[int], str] = rank_named,
    shared_progress: tuple[str, ...] = (),
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new ranks and return each rank's result.

    ``fn`` must be picklable (a module-level function) and runs inside an
    initialized process group whose collectives time out after ``timeout_s``.
    Rank 0's progress events (:mod:`osdpipe.run.progress`) are drawn on ``display``;
    with ``shared_progress``, every rank's events of those kinds, and no others.
    ``who``: what an error calls a process (``"worker 1 of 2 on node-a"``, where
    the processes play shares of a target world, not its ranks).

    Raises:
        WorldError: when a rank raises, dies, or the world outlives ``timeout_s``
            (then every rank is terminated).
    """
    ctx = rankserver.context()
    results = ctx.Queue()
    events = ctx.Queue() if display is not None and display.enabled else None
    board = whereabouts.Board(ctx, world_size)
    # Where each rank writes its standard error, and its stacks if a signal kills it (osdpipe.run.native_crash).
    rank_files = Path(tempfile.mkdtemp(prefix="osdpipe-ranks-"))
    port = free_port()
    backend = backend_for(backend, world_size)
    seen = remote_input.seen()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r, world_size, port, backend, timeout_s, fn, args, results, events, board.cells, shared_progress,
                str(rank_files), seen,
            ),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    try:
        while len(outcome) < world_size:
            now = time.monotonic()
            if now > deadline or (first_failure is not None and now > first_failure + GRACE_S):
                break
            _drain(events, display)
            try:
                rank, ok, value = pickle.loads(results.get(timeout=0.2))
                outcome[rank] = (ok, value)
                if not ok and first_failure is None:
                    first_failure = time.monotonic()
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode not in (None, 0)]
                for r in dead:
                    dump = native_crash.read(native_crash.dump_path(rank_files, r))
                    printed = native_crash.read(native_crash.stderr_path(rank_files, r))
                    code, last = native_crash.innermost(dump), native_crash.last_words(printed)
                    said = death(procs[r].exitcode, board.stage_of(r), code, last)
                    outcome[r] = (False, RankFailure(said, _dead_rank_record(dump, printed)))
                if dead and first_failure is None:
                    first_failure = time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(rank_files, ignore_errors=True)
    _drain(events, display)
    failures = {r: v for r, (ok, v) in outcome.items() if not ok}  # in the order they arrived
    missing = [r for r in range(world_size) if r not in outcome]
    if failures:
        raise world_error(failures, who)
    if missing:
        raise WorldError(
            {r: "timed out" for r in missing}, f"{', '.join(map(who, missing))} did not finish within {timeout_s:.0f} s"
        )
    return [outcome[r][1] for r in range(world_size)]


def _drain(events: Any, display: progress.Display | None) -> None:
    """Draw every progress event rank 0 has sent, then move the clock."""
    if events is None or display is None:
        return
    while True:
        try:
            display(events.get_nowait())
        except queue.Empty:
            break
    display.tick()
