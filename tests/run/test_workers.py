"""Workers playing shares of a target world (``runtime.workers``, torchrun offline), through the ``osdpipe`` command.

One source, the user's own model (``userlm``) trained unwrapped, converted
offline to 4 and to 7 target ranks, as rank files and as a DCP checkpoint,
by 1, 2 and 3 local workers, and to 7 by a 2-node torchrun world (two
torchrun agents meeting through a c10d rendezvous on 127.0.0.1; seven ranks
cannot be split evenly between them). Every output is the
same bytes, file for file, and its manifest's ``content_sha256`` is the
same; the DCP checkpoint that 3 workers wrote for 7 ranks resumes on a real
2-rank FSDP2 world. A worker that dies or fails mid-save ends the run with
one line naming it, its node and the stage, and the previous conversion
stays as it was.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import fsdp2_resume
import pytest
from helpers import clean_env, processes_marked, run_cli_cases, run_command, torchrun_two_nodes, user_env
from oracle_probe import spawn_world

from osdpipe.run.world import balanced_shares

#: End to end: local worlds and torchrun agents (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1] / "support"
TIMEOUT_S = 240

JOB = ["model.factory=userlm:build", "input.format=fsdp_full", "source.world_size=4",
       "target.kind=fsdp2", "target.wrap=[MixerBlock]", "target.wrap_root=true",
       "runtime.mode=offline"]  # fmt: skip
TARGETS = {
    f"{fmt}-{size}": (f"output.format={fmt}", f"target.world_size={size}")
    for fmt in ("rank_local", "dcp")
    for size in (4, 7)
}
LOCAL_WORKERS = (1, 2, 3)
#: The targets a 2-node torchrun world also converts: seven ranks cannot be split evenly between two nodes, the case
#: an even split adds nothing to but two more torchrun worlds' start-up.
TORCHRUN_TARGETS = ("rank_local-7", "dcp-7")


def test_the_progress_line_sums_every_workers_share() -> None:
    from osdpipe.run.progress import Display

    display = Display(True)
    display.phase("offline: 7 target rank(s) on 2 workers", unit="B")
    display(("share", 1, 100, 400))
    display(("share", 0, 50, 300))
    display(("share", 1, 400, 400))
    assert (display._bar.n, display._bar.total) == (450, 700)
    display(("share", 2, 0, None))  # a worker whose ranks wrote nothing yet: the total is not known
    assert (display._bar.n, display._bar.total) == (450, None)
    display.phase("next")
    display(("share", 0, 1, 2))
    assert (display._bar.n, display._bar.total) == (1, 2), "a new phase forgets the last one's shares"
    display.close()


def test_shares_are_consecutive_runs_that_cover_every_rank_balanced_by_weight() -> None:
    for weights, parts in [
        ([1] * 7, 3),
        ([5, 5, 5, 5], 4),
        ([10, 1, 1, 1], 2),
        ([1, 1, 1, 10], 2),
        ([3, 0, 0, 0], 3),
        ([4, 4, 1, 1, 1, 1], 2),
        ([7], 1),
    ]:
        shares = balanced_shares(weights, parts)
        assert len(shares) == parts and all(len(s) >= 1 for s in shares), (weights, parts, shares)
        assert [r for s in shares for r in s] == list(range(len(weights))), (weights, parts, shares)
        heaviest = max(sum(weights[r] for r in s) for s in shares)
        assert heaviest <= sum(weights) / parts + max(weights), (weights, parts, shares)
    assert [list(s) for s in balanced_shares([1] * 8, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(s) for s in balanced_shares([10, 1, 1, 1], 2)] == [[0], [1, 2, 3]]  # by weight, not by count
    with pytest.raises(ValueError, match="3 workers cannot each play at least one of 2 target ranks"):
        balanced_shares([1, 1], 3)


@pytest.fixture(scope="module")
def full_source(tmp_path_factory) -> Path:
    import userlm

    return userlm.save_trained(tmp_path_factory.mktemp("user_job") / "optim.pt", steps=2)


def _files(directory: Path) -> dict[str, str]:
    """sha256 of every file of a conversion but the run's own record and the manifest
    (which names its path and how it ran)."""
    skip = ("report.json", "osdpipe.log", "manifest.json")
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in skip
    }


@pytest.fixture(scope="module")
def converted(full_source: Path, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(target, who) -> output directory: every target by 1, 2 and 3 local workers, and :data:`TORCHRUN_TARGETS` by a
    2-node torchrun world."""
    root = tmp_path_factory.mktemp("workers")
    outs = {(target, f"local-{w}"): root / f"{target}-local-{w}" for target in TARGETS for w in LOCAL_WORKERS}
    cases = [
        [*JOB, *TARGETS[t], f"runtime.workers={who.split('-')[1]}", f"input.path={full_source}", f"output.path={out}"]
        for (t, who), out in outs.items()
    ]
    for (key, out), result in zip(outs.items(), run_cli_cases(cases, cwd=root, per_case_s=TIMEOUT_S, env=user_env())):
        assert result["code"] == 0, f"{key}: exit {result['code']}\n{result['stdout']}\n{result['stderr']}"
    for target in TORCHRUN_TARGETS:
        out = root / f"{target}-torchrun-2x1"
        agents = torchrun_two_nodes(
            [*JOB, *TARGETS[target], f"input.path={full_source}", f"output.path={out}"], (root, root), user_env(),
            TIMEOUT_S,
        )
        assert all(code == 0 for code, _ in agents), f"{target}: {agents}"
        outs[(target, "torchrun-2x1")] = out
    return outs


@pytest.mark.parametrize("target", TARGETS)
def test_every_number_of_workers_writes_the_same_bytes(converted: dict[tuple[str, str], Path], target: str) -> None:
    runs = {who: out for (t, who), out in converted.items() if t == target}
    by_torchrun = {"torchrun-2x1"} if target in TORCHRUN_TARGETS else set()
    assert set(runs) == {f"local-{w}" for w in LOCAL_WORKERS} | by_torchrun, f"{target}: not every way ran"
    alone = _files(runs["local-1"])
    size = int(target.split("-")[1])
    expected = (
        {f"rank_{r}.pt" for r in range(size)}
        if target.startswith("rank_local")
        else {f"dcp/__{r}_0.distcp" for r in range(size)} | {"dcp/.metadata"}
    )
    assert set(alone) == expected
    contents = {}
    for who, out in runs.items():
        assert _files(out) == alone, f"{who} wrote other bytes than one process"
        manifest = json.loads((out / "manifest.json").read_text())
        contents[who] = manifest["content_sha256"]
        report = json.loads((out / "report.json").read_text())
        assert report["ok"] and [c["name"] for c in report["checks"]] == ["roundtrip", "resume"], report
        workers = 1 if who == "local-1" else int(who.split("-")[-1][0]) if who.startswith("local") else 2
        assert [m["process"] for m in report["memory"]] == (
            ["offline"] if workers == 1 else [f"worker {w}" for w in range(workers)]
        )
    assert len(set(contents.values())) == 1, contents


def test_a_dcp_checkpoint_three_workers_wrote_for_7_ranks_resumes_on_a_real_2_rank_world(
    full_source: Path, converted
) -> None:
    out = converted[("dcp-7", "local-3")]
    assert spawn_world(
        fsdp2_resume.resume, 2, (str(full_source), str(out / "dcp"), "dcp"), timeout_s=TIMEOUT_S
    ) == [[], []]


def test_a_changed_element_is_found_in_a_workers_output(full_source: Path, converted, tmp_path: Path) -> None:
    """The outputs compared above are not all alike by accident: one changed byte in a file written by worker 2
    differs."""
    out = tmp_path / "changed"
    shutil.copytree(converted[("rank_local-7", "local-3")], out)
    victim = out / "rank_6.pt"
    data = bytearray(victim.read_bytes())
    data[-200] ^= 1
    victim.write_bytes(bytes(data))
    assert _files(out) != _files(converted[("rank_local-7", "local-1")])


#: The one line each failure must give: (fault, the line's start). Worker 1 plays target ranks 2 and 3 of 4.
FAILURES = {
    "kill": ("save:1:kill", "worker 1 of 2 on {host} failed: process killed by SIGKILL in stage 'save'"),
    "raise": (
        "save:1:raise",
        "stage 'save' failed on rank 2 (played by worker 1 of 2 on {host}): "
        "RuntimeError: injected fault save on rank 1",
    ),
}


@pytest.mark.parametrize("case", FAILURES)
def test_a_worker_that_dies_mid_save_ends_the_run_and_leaves_the_previous_conversion(
    full_source: Path, converted, tmp_path: Path, case: str
) -> None:
    fault, expected = FAILURES[case]
    expected = expected.format(host=socket.gethostname())
    before = converted[("rank_local-4", "local-2")]
    out, mark = tmp_path / "out", uuid.uuid4().hex
    shutil.copytree(before, out)
    env = clean_env()
    env.update(OSDPIPE_TEST_FAULT=fault, OSDPIPE_TEST_MARK=mark, PYTHONPATH=f"{TESTS}:{TESTS / 'faults'}")
    args = [
        *JOB, *TARGETS["rank_local-4"], "runtime.workers=2", "runtime.timeout_s=60", "output.overwrite=true",
        f"input.path={full_source}", f"output.path={out}",
    ]
    start = time.monotonic()
    result = run_command([sys.executable, "-m", "osdpipe", *args], cwd=tmp_path, timeout=120, env=env)
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("osdpipe: error: " + expected), result.stderr
    assert time.monotonic() - start < 30, "the run waited on the dead worker"
    deadline = time.monotonic() + 10
    while processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_marked(mark), "a worker was left behind"
    assert (
        _files(out) == _files(before)
        and (out / "manifest.json").read_bytes() == (before / "manifest.json").read_bytes()
    )
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "the failed run left its staging behind"
    assert not json.loads((out / "report.json").read_text())["ok"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["runtime.workers=2"], "runtime.workers=2 plays the target's ranks offline; set runtime.mode=offline"),
        (
            ["runtime.mode=offline", "runtime.workers=5", "target.world_size=4"],
            "runtime.workers=5 is more than target.world_size=4",
        ),
        (["runtime.mode=offline", "runtime.workers=0"], "runtime.workers"),
    ],
)
def test_workers_that_cannot_play_the_target_are_refused_in_one_line(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    result = run_command(
        [sys.executable, "-m", "osdpipe", *overrides, f"output.path={tmp_path / 'out'}"],
        cwd=tmp_path,
        timeout=120,
        env=user_env(),
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_as_many_workers_as_target_ranks_is_the_target_world_where_every_check_runs(
    full_source: Path, converted, tmp_path: Path
) -> None:
    """W = M is the online run: the checks that need the live target job (reference, load_step) run,
    and the bytes are the others'."""
    out = tmp_path / "w4"
    args = [*JOB, *TARGETS["rank_local-4"], "runtime.workers=4", f"input.path={full_source}", f"output.path={out}"]
    result = run_command([sys.executable, "-m", "osdpipe", *args], cwd=tmp_path, timeout=TIMEOUT_S, env=user_env())
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert (
        [c["name"] for c in report["checks"]] == ["roundtrip", "reference", "load_step", "resume"] and report["ok"]
    ), report["checks"]
    assert [m["process"] for m in report["memory"]] == [f"rank {r}" for r in range(4)]
    assert _files(out) == _files(converted[("rank_local-4", "local-1")])
