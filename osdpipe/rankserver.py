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
are spawned.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
from multiprocessing import forkserver
import os
import signal
from typing import Any

#: What every rank imports: the fork server imports it once, and each rank starts with it loaded.
PRELOAD = ["torch._dynamo", "osdpipe.pipeline", "osdpipe.generate", "osdpipe.stages", "osdpipe.kinds.fsdp1", "osdpipe.kinds.fsdp2"]

#: Command-line words after which the command starts no local ranks (help, config printing, offline, torchrun).
NO_RANKS = ("--help", "-h", "--version", "--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc", "runtime.mode=offline", "runtime.launcher=torchrun")

_started = False


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or anything that sets its environment)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def context() -> Any:
    """The multiprocessing context ranks start from: the fork server where the platform has one, else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
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


def start_early(args: list[str]) -> None:
    """:func:`start`, unless the command line or the environment says no local ranks will start."""
    if not in_torchrun() and not any(a.lstrip("+") in NO_RANKS for a in args):
        start()


def _stop() -> None:
    # A server still importing when the command ends (a config error) would
    # otherwise finish importing before it noticed.
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
