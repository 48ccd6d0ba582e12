"""A rank that dies mid-stage ends the whole run at once: stage and rank named, exit 1, no process left,
the output as it was.

Through the ``osdpipe`` command on a user's model (``userlm``), with a
previous conversion already in the output directory. ``tests/support/faults`` on
``PYTHONPATH`` makes one rank die on cue (``OSDPIPE_TEST_FAULT``, see its
``sitecustomize.py``): killed with SIGKILL, which runs nothing after it,
aborting as native code does (named by the code it was in), or
raising, while it loads the source, while it sends or receives ranges
(``runtime.transfer=scatter`` under a small ``runtime.memory_budget``, so
there are many messages), and after writing its file in ``save``. Under the
local launcher and under torchrun, where every surviving rank must exit 1
with its own line. Under the local launcher every rank also prints a line as
it tears its group down (``OSDPIPE_TEST_NOISY_TEARDOWN``), as a survivor's
glibc once did in CI: the command must still say one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import clean_env, processes_marked, run_command

from osdpipe.run.launch import free_port

#: End to end: it starts worlds, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1] / "support"
TIMEOUT_S = 60  # runtime.timeout_s: every run must end well inside it
WORLD = 3  # two survivors of each death

#: A conversion whose shard stage sends many messages under scatter, and writes rank files.
JOB = ["model.factory=userlm:build", "input.format=fsdp_full", "source.world_size=1",
       f"target.world_size={WORLD}", "target.wrap=[MixerBlock]",
       "runtime.memory_budget=2KB", f"runtime.timeout_s={TIMEOUT_S}", "output.overwrite=true"]  # fmt: skip
SCATTER = ["runtime.transfer=scatter"]


def _env(fault: str | None = None, mark: str | None = None, *, noisy: bool = False) -> dict[str, str]:
    """The command's environment: ``fault`` on cue; ``noisy``: every rank prints a line as it tears down its group."""
    env = clean_env()
    if noisy:
        env["OSDPIPE_TEST_NOISY_TEARDOWN"] = "1"
    if mark:
        env["OSDPIPE_TEST_MARK"] = mark
    paths = [str(TESTS), *([str(TESTS / "faults")] if fault else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if fault:
        env["OSDPIPE_TEST_FAULT"] = fault
    return env


def _conversion(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` but the run's own record (``report.json``, ``osdpipe.log``)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in ("report.json", "osdpipe.log")
    }


def _no_process_left(mark: str) -> None:
    """No process of the run (marked through its environment, torchrun's ranks in their own sessions included) is still
    alive."""
    deadline = time.monotonic() + 10
    while (left := processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> tuple[Path, Path]:
    """The user's input, and an output directory holding a conversion of it made before any fault."""
    import userlm

    root = tmp_path_factory.mktemp("dead_rank")
    torch.manual_seed(0)
    model = userlm.build()
    source = root / "optim.pt"
    torch.save(userlm.fqn_keyed(model, userlm.train(model, steps=2)), source)
    out = root / "previous"
    result = run_command(
        [sys.executable, "-m", "osdpipe", *JOB, f"input.path={source}", f"output.path={out}"],
        cwd=root,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(WORLD)]
    return source, out


#: (fault, extra overrides, what the one error line must say). Rank 0 hosts the world's store and reads for the others
#: under scatter.
LOCAL_CASES = {
    "load-kill": ("load:1:kill", [], "rank 1 failed: process killed by SIGKILL in stage 'load'"),
    "load-raise": ("load:2:raise", [], "stage 'load' failed on rank 2: RuntimeError: injected fault load on rank 2"),
    "send-kill": ("send:0:kill", SCATTER, "rank 0 failed: process killed by SIGKILL in stage 'shard'"),
    "receive-kill": ("receive:2:kill", SCATTER, "rank 2 failed: process killed by SIGKILL in stage 'shard'"),
    "receive-raise": (
        "receive:1:raise", SCATTER, "stage 'shard' failed on rank 1: RuntimeError: injected fault receive on rank 1"
    ),
    "save-kill": ("save:1:kill", [], "rank 1 failed: process killed by SIGKILL in stage 'save'"),
    "save-raise": ("save:0:raise", [], "stage 'save' failed on rank 0: RuntimeError: injected fault save on rank 0"),
    # as native code dies (glibc's heap checks abort): the line names the Python code the rank was in
    "save-abort": (
        "save:1:abort", [], "rank 1 failed: process killed by SIGABRT in stage 'save' without reporting an error (in "
    ),
    # glibc's own line goes into the rank's error line, not beside it on the terminal
    "save-glibc": (
        "save:2:glibc", [], "rank 2 failed: process killed by SIGABRT in stage 'save' without reporting an error (in "
    ),
}


@pytest.mark.parametrize("case", LOCAL_CASES)
def test_a_rank_that_dies_ends_the_run_at_once_and_leaves_the_output_as_it_was(
    previous, tmp_path: Path, case: str
) -> None:
    fault, extra, expected = LOCAL_CASES[case]
    source, before = previous
    out, mark = tmp_path / "out", uuid.uuid4().hex
    shutil.copytree(before, out)
    start = time.monotonic()
    result = run_command(
        [sys.executable, "-m", "osdpipe", *JOB, *extra, f"input.path={source}", f"output.path={out}"],
        cwd=tmp_path,
        timeout=TIMEOUT_S + 30,
        env=_env(fault, mark, noisy=True),  # what the ranks print as they tear down must not add to the one line
    )
    seconds = time.monotonic() - start
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("osdpipe: error: " + expected), result.stderr
    if fault.endswith(":abort"):
        named = r"sitecustomize\.py:\d+ in _die, called from osdpipe/io/formats/\S+:\d+ in \w+\) \(report: "
        assert re.search(named, lines[0]), lines
    if fault.endswith(":glibc"):
        assert re.search(r"in \w+\); it printed 'free\(\): invalid pointer' \(report: ", lines[0]), lines
    assert seconds < TIMEOUT_S / 2, f"the run took {seconds:.0f} s: it waited on the dead rank"
    _no_process_left(mark)
    assert _conversion(out) == _conversion(before), "the failed run changed the previous conversion"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "the failed run left its staging behind"
    report = json.loads((out / "report.json").read_text())
    assert not report["ok"] and report["error"].startswith(expected)
    if fault.endswith(":glibc"):  # what it printed is kept for runtime.debug and bug reports
        assert "standard error:\nfree(): invalid pointer" in report["traceback"]


#: Under torchrun each rank is its own process: (fault, extra, the dead rank, the stage every survivor names).
TORCHRUN_CASES = {
    "save-kill": ("save:1:kill", [], 1, "save"),
    "receive-kill-reader": ("receive:2:kill", SCATTER, 2, "shard"),
    "save-kill-rank0": ("save:0:kill", [], 0, "save"),
}


@pytest.mark.parametrize("case", TORCHRUN_CASES)
def test_under_torchrun_every_survivor_exits_1_naming_the_stage_and_itself(previous, tmp_path: Path, case: str) -> None:
    fault, extra, dead, stage = TORCHRUN_CASES[case]
    source, before = previous
    out, mark = tmp_path / "out", uuid.uuid4().hex
    shutil.copytree(before, out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--master-port", str(free_port()), "--tee", "3", "--log-dir", str(tmp_path / "logs"),
           "-m", "osdpipe", *JOB, *extra, f"input.path={source}", f"output.path={out}"]  # fmt: skip
    start = time.monotonic()
    result = run_command(cmd, cwd=tmp_path, timeout=TIMEOUT_S + 30, env=_env(fault, mark))
    seconds = time.monotonic() - start
    assert result.returncode != 0, result.stdout
    assert seconds < TIMEOUT_S / 2, f"the run took {seconds:.0f} s: it waited on the dead rank"
    exits = {
        int(r): int(code)
        for r, code in re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", result.stderr)
    }
    assert exits == {r: -9 if r == dead else 1 for r in range(WORLD)}, (
        f"torchrun's table of exit codes:\n{result.stderr}"
    )
    for rank in set(range(WORLD)) - {dead}:
        lines = [line for line in result.stderr.splitlines() if line.startswith(f"[default{rank}]:osdpipe: error:")]
        assert len(lines) == 1 and f"stage '{stage}' failed on rank {rank}:" in lines[0], (
            f"rank {rank}:\n{result.stderr}"
        )
    _no_process_left(mark)
    assert _conversion(out) == _conversion(before), "the failed run changed the previous conversion"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "the failed run left its staging behind"
    assert not json.loads((out / "report.json").read_text())["ok"]
