"""The fork server that local ranks start from: torch imported once, not once per rank.

A spawned rank imports torch, torch._dynamo (which the first meta-device op
pulls in) and osdpipe itself: about three seconds of CPU each, which is most
of a small conversion. Ranks instead fork from multiprocessing's fork server,
a fresh single-threaded process that imports them once (:data:`PRELOAD`), so
no thread, process group or CUDA context of the launcher reaches a rank.

The command starts the server first thing (:func:`start_early`, before it
imports torch itself), so the server's imports run alongside the launcher's
own; it is stopped when the command exits, used or not. This module imports
nothing heavy for that reason. Where the platform has no fork server, ranks
are spawned; so they are where the server's socket would not fit under the
temporary folder (``TMPDIR``): an ``AF_UNIX`` path holds 107 bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import tempfile
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

#: What every rank imports: the fork server imports it once, and each rank starts with it loaded.
PRELOAD = [
    "torch._dynamo",
    "osdpipe.pipeline.execute",
    "osdpipe.run.generate",
    "osdpipe.pipeline.stages",
    "osdpipe.layout.kinds.fsdp1",
    "osdpipe.layout.kinds.fsdp2",
]

#: Command-line words after which the command runs no conversion, so starts no ranks (help, config printing).
NO_RUN = ("--help", "-h", "--version", "--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc")

_started = False


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or anything that sets its environment)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def joins_torchrun(launcher: str) -> bool:
    """Whether a run with ``runtime.launcher=launcher`` joins a torchrun world: asked for, or ``auto`` inside one."""
    return launcher == "torchrun" or (launcher == "auto" and in_torchrun())


#: The longest path of an ``AF_UNIX`` socket (``sun_path``: 108 bytes with its terminating NUL).
SOCKET_PATH_MAX = 107
#: What multiprocessing puts under the temporary folder for the fork server's socket:
#: ``/pymp-<8 characters>/listener-<8 characters>``.
SOCKET_SUFFIX = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def socket_fits(folder: str) -> bool:
    """Whether the fork server's socket fits under ``folder`` (the temporary folder: ``TMPDIR``)."""
    return len(os.fsencode(folder)) + SOCKET_SUFFIX <= SOCKET_PATH_MAX


def context() -> Any:
    """The multiprocessing context ranks start from: the fork server where the platform has one and its socket fits
    under the temporary folder (a long ``TMPDIR`` made the command fail with "AF_UNIX path too long"), else spawn."""
    if "forkserver" not in mp.get_all_start_methods() or not socket_fits(tempfile.gettempdir()):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start() -> None:
    """Start the fork server now (it preloads in the background); it is stopped when this process exits."""
    global _started
    if _started or context().get_start_method() != "forkserver":
        return
    forkserver.ensure_running()
    atexit.register(_stop)
    _started = True


def starts_ranks(mode: str, workers: int, input_given: bool, launcher: str) -> bool:
    """Whether a run starts ranks on this machine: an online run's target world, an offline run's workers, and the
    training that makes a source where no ``input.path`` is given; none of them where it joins a torchrun world
    (the command is a rank itself)."""
    if joins_torchrun(launcher):
        return False
    return mode == "online" or workers > 1 or not input_given


def ranks_may_start(args: list[str]) -> bool:
    """:func:`starts_ranks` for a command line, before anything is composed: what the words say, and what a key they
    leave out defaults to (online, one worker, no input, launcher ``auto``); never after a :data:`NO_RUN` word.
    A recipe that sets those keys is judged again on the composed run (``osdpipe.cli.compose``)."""
    words = [a.lstrip("+") for a in args]
    if any(w in NO_RUN for w in words):
        return False
    said = dict(w.split("=", 1) for w in words if "=" in w)
    workers = said.get("runtime.workers", "1")
    return starts_ranks(
        mode=said.get("runtime.mode", "online"),
        workers=int(workers) if workers.isdigit() else 1,
        input_given="input.path" in said,
        launcher=said.get("runtime.launcher", "auto"),
    )


def start_early(args: list[str]) -> None:
    """:func:`start`, unless the command line or the environment says no local ranks will start."""
    if ranks_may_start(args):
        start()


def call_apart(fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """``fn(*args)`` in a process of its own, forked from the server (torch imported once), and what it returns.

    For work that needs a process to itself but no world: PyTorch's fake
    process group, say, which is one per process and must not meet the
    caller's own. The server is started if it is not running; where the
    platform has none, the process is spawned.

    Raises:
        ValueError: what ``fn`` raised, in one line (its own words for a ``ValueError``).
        TimeoutError: ``fn`` took longer than ``timeout_s``; its process is killed.
    """
    start()
    ctx = context()
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_answer, args=(sender, fn, args), daemon=True)
    proc.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} took over {timeout_s:g} s")
        ok, value = receiver.recv()
    except EOFError:
        proc.join(timeout=10)
        raise ValueError(
            f"the process running {getattr(fn, '__qualname__', fn)} died (exit code {proc.exitcode})"
        ) from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        receiver.close()
    if not ok:
        raise ValueError(value)
    return value


def _answer(sender: Any, fn: Callable[..., Any], args: tuple) -> None:
    try:
        reply = (True, fn(*args))
    except ValueError as exc:
        reply = (False, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    except Exception as exc:  # noqa: BLE001 - the caller's error says it in one line
        reply = (False, f"{type(exc).__name__}: {exc}".splitlines()[0])
    sender.send(reply)
    sender.close()


def _stop() -> None:
    # A server still importing when the command ends (a config error) would
    # otherwise finish importing before it noticed.
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
