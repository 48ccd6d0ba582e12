"""Shared by the end-to-end tests: run a command in a subprocess that can never hang the suite."""

from __future__ import annotations

import fcntl
import hashlib
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

#: torchrun's environment: a test run inside one must not make osdpipe join it.
WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(*drop: str) -> dict[str, str]:
    """This environment without torchrun's variables (and ``drop``), with ``CI=true`` (no progress bars)."""
    env = {k: v for k, v in os.environ.items() if k not in (*WORLD_ENV, *drop)}
    env["CI"] = "true"
    return env


#: This folder: the user's own modules (``userlm``, ``usermodel``, ...) import from here;
#: ``faults`` under it injects failures.
TESTS = Path(__file__).resolve().parent
#: The tests' folder: the real frameworks' jobs name their models from it (``frameworks.ds_job:DsLM``).
ALL_TESTS = TESTS.parent


def user_env(**variables: str) -> dict[str, str]:
    """A command's environment as a user's: :func:`clean_env`, with the user's own modules importable (this folder and
    the tests' on ``PYTHONPATH``).

    ``variables`` (``OSDPIPE_TEST_*``) are set, and ``tests/support/faults`` is put on the path to act on them.
    """
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(ALL_TESTS), *([str(TESTS / "faults")] if variables else []), env.get("PYTHONPATH", "")]
    )
    env.update(variables)
    return env


def run_command(
    cmd: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; past ``timeout`` kill it with every rank it spawned, and fail."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a descendant in a session of its own (torchrun's workers) holds the pipes
            out, err = "", "(no output: processes outside the command's session kept its pipes open)"
        pytest.fail(
            f"{' '.join(map(str, cmd))} did not finish within {timeout} s\n--- stdout\n{out}\n--- stderr\n{err}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_osdpipe(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m osdpipe *args`` in ``cwd``."""
    return run_command([sys.executable, "-m", "osdpipe", *args], cwd=cwd, timeout=timeout)


def run_with_terminal_stderr(
    args: list[str], cwd: Path, env: dict[str, str], timeout_s: float, size: tuple[int, int] = (24, 120)
) -> tuple[int, str]:
    """Run the ``osdpipe`` command with stderr on a pseudo-terminal (as in a user's shell), killed after
    ``timeout_s``; returns its exit code and what the terminal showed (the live progress line among it). ``size``:
    the terminal's rows and columns as it reports them (``(0, 0)``: a fresh pty's, never set)."""
    leader, follower = pty.openpty()
    # a user's terminal has a size; a fresh pty has none
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "osdpipe", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    shown = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the command ended
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    try:  # the terminal closes as the command exits, a moment before it is gone
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail(f"did not finish within {timeout_s} s")
    return code, shown.decode(errors="replace")


def run_cli_cases(
    cases: list[list[str]], *, cwd: Path, per_case_s: int = 30, env: dict[str, str] | None = None
) -> list[dict]:
    """Each argument list through the ``osdpipe`` entry point, all in one subprocess (see ``cli_driver.py``).

    Returns per case its exit ``code`` (``"hung"`` past ``per_case_s``), ``stdout``, ``stderr`` and ``seconds``.
    """
    import json

    driver = Path(__file__).with_name("cli_driver.py")
    proc = subprocess.run(
        [sys.executable, str(driver), str(per_case_s)],
        input=json.dumps(cases),
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=per_case_s * len(cases) + 60,
    )
    assert proc.returncode == 0, f"the driver failed\n{proc.stderr}"
    return json.loads(proc.stdout)


def torchrun_two_nodes(
    args: list[str], cwds: tuple[Path, Path], env: dict[str, str], timeout: float
) -> list[tuple[int, str]]:
    """``osdpipe *args`` under two torchrun agents (``--nnodes 2``, one process each) meeting through a c10d
    rendezvous on 127.0.0.1, each started in its own directory of ``cwds`` (two nodes: the same one given twice shares
    it); each agent's exit code and output (stdout and stderr)."""
    import uuid

    from osdpipe.run.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", uuid.uuid4().hex,
           "-m", "osdpipe", *args]  # fmt: skip
    agents = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cwd in cwds
    ]
    try:
        return [(a.wait(timeout=timeout), a.stdout.read()) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()


def processes_marked(mark: str) -> list[int]:
    """PIDs of live processes whose environment holds ``OSDPIPE_TEST_MARK=mark``: a command's and every descendant's,
    whatever session they run in (torchrun starts each rank in a session of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"OSDPIPE_TEST_MARK={mark}".encode() in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def planned(spec, input_path=None, input_format=None):
    """The plan of ``spec`` as the launcher builds it; reading a test's own source at ``input_path`` when given."""
    import dataclasses

    from osdpipe.spec.plan import plan_run

    plan = plan_run(spec)
    if input_path is None:
        return plan
    return dataclasses.replace(plan, input_path=str(input_path), input_format=input_format or plan.input_format)


def run_stages_by_hand(spec, input_path, input_format, names):
    """This rank's products of ``names``, each stage called with the one before's (no loop): ``{name: product}``."""
    from osdpipe.pipeline.stages import STAGES
    from osdpipe.run.context import Context
    from osdpipe.run.products import Tally
    from osdpipe.run.world import GroupWorld

    world = GroupWorld()
    ctx = Context(planned(spec, input_path, input_format), world, world.rank)
    products, product = {}, None
    for name in names:
        product = products[name] = STAGES[name](ctx, product, Tally())
    return ctx, products


def digest_by_hand(path: Path, pieces: list[int] | None = None) -> str:
    """A file's digest as the manifest's ``digests`` tells a person to take it, written here independently of osdpipe.

    With ``pieces``: cut the file at those lengths, sha256 each piece, and
    sha256 the lowercase hex digests, a newline after each. Without: the
    file's sha256 (what ``sha256sum`` prints).
    """
    data = path.read_bytes()
    if pieces is None:
        return hashlib.sha256(data).hexdigest()
    assert sum(pieces) == len(data), f"{path}: pieces of {sum(pieces)} bytes in a file of {len(data)}"
    starts = [sum(pieces[:i]) for i in range(len(pieces))]
    lines = "".join(hashlib.sha256(data[a : a + n]).hexdigest() + "\n" for a, n in zip(starts, pieces))
    return hashlib.sha256(lines.encode()).hexdigest()


def manifest_digests_hold(directory: Path, manifest: dict) -> dict[str, bool]:
    """Per file the manifest lists, whether its digest is the one taken by hand (:func:`digest_by_hand`)."""
    pieces = manifest.get("pieces", {})
    return {
        name: digest_by_hand(directory / name, pieces.get(name)) == digest for name, digest in manifest["files"].items()
    }
