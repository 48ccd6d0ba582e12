"""Launching the real frameworks' jobs: one logged, killable command per job
(shared by :mod:`frameworks.accel` and :mod:`frameworks.ds`).

A job runs in its own session so that a hang is killed as a process group
(torchrun and every rank), never by name; its output goes to
``<workdir>/<label>.log``, whose tail a failure shows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent


def worker_env(**variables: str) -> dict[str, str]:
    """This process's environment for a job's ranks: one thread per rank (CI has 2 cores), quiet warnings, tracebacks on
    crashes, the tests importable; ``variables`` set on top."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1", **variables)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(TESTS / "support"), env.get("PYTHONPATH", "")) if p)
    return env


def torchrun(nproc: int, entry: Path, spec: dict[str, Any]) -> list[str]:
    """The command that runs ``entry`` on ``nproc`` local ranks with ``spec`` as its one argument (JSON)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(entry), json.dumps(spec),
    ]


def run_then_leave(main: Callable[[], None]) -> None:
    """A launched job's ``main``, then its exit without the interpreter's teardown.

    Why: once the work is done and written, a background thread of gloo, or
    of DeepSpeed (which accelerate imports where it is installed), can abort
    that teardown ("terminate called without an active exception"), failing
    a finished job. An error in ``main`` still raises as usual.
    """
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_logged(cmd: list[str], workdir: Path, *, label: str, timeout: float, what: str, env: dict[str, str]) -> float:
    """Run ``cmd`` in ``workdir`` and wait; its seconds. Raise with the log's tail if it fails or outlives
    ``timeout``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{label}.log"
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    if rc != 0:
        tail = log.read_text(errors="replace")[-6000:]
        why = f"timed out after {timeout}s" if rc is None else f"exit code {rc}"
        raise RuntimeError(f"{what} {label} failed: {why}; log {log}:\n{tail}")
    return time.monotonic() - start
