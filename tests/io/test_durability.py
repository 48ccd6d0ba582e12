"""A committed conversion is on disk, and a crash anywhere in the commit leaves the previous conversion or the new one,
whole.

Syncs are seen in-process: ``os.fsync`` and ``os.replace`` are recorded (the
file behind each descriptor read from ``/proc``) while the launcher converts
offline, so the order of syncs and renames can be held against the commit's
rules (:mod:`osdpipe.io.output`). Crashes are real: the ``osdpipe`` command is
killed with SIGKILL right after each rename of its commit (``tests/support/faults``),
over a directory that holds a previous conversion; then what the next run
does first (:func:`osdpipe.io.output.recover`) must leave exactly one of the
two conversions, every file as its manifest says.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import run_cli_cases, run_command, user_env

#: End to end: each kill point runs the command once.
pytestmark = pytest.mark.slow

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    import userlm

    return userlm.save_trained(tmp_path_factory.mktemp("durable") / "optim.pt", steps=1)


def _job(source: Path, world: int, out: Path, *extra: str) -> list[str]:
    return [
        "model.factory=userlm:build", f"input.path={source}", "input.format=fsdp_full",
        "source.world_size=4", "target.wrap=[MixerBlock]", f"target.world_size={world}",
        "runtime.mode=offline", "output.overwrite=true", f"output.path={out}", *extra,
    ]


def _conversion(directory: Path) -> dict[str, str]:
    """What a conversion in ``directory`` is, wherever it lies: each data file's sha256 and the manifest's
    ``content_sha256``."""
    out = {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
        and p.name not in ("report.json", "osdpipe.log", "manifest.json")
        and not p.relative_to(directory).parts[0].startswith(".")
    }
    manifest = directory / "manifest.json"
    out["manifest"] = json.loads(manifest.read_text())["content_sha256"] if manifest.is_file() else "none"
    return out


# ---------------------------------------------------------------------------- syncs


def _convert_recording(source: Path, out: Path, tmp_path: Path, *extra: str) -> list[tuple]:
    """The ``osdpipe`` command (offline: the launcher writes and commits) with every ``fsync`` and ``os.replace`` it
    makes recorded, in order."""
    log = tmp_path / f"syncs_{out.name}.tsv"
    env = user_env(OSDPIPE_TEST_RECORD_SYNCS=str(log))
    result = run_command(
        [sys.executable, "-m", "osdpipe", *_job(source, 3, out, *extra)], cwd=tmp_path, timeout=TIMEOUT_S, env=env
    )
    assert result.returncode == 0, result.stderr
    return [tuple(line.split("\t")) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("fmt", ["rank_local", "dcp"])
def test_every_committed_file_and_the_directory_are_synced_around_the_renames(
    source: Path, tmp_path: Path, fmt: str
) -> None:
    """Every file the manifest lists, and the manifest, synced while staged, before ``.staging`` is renamed; the output
    directory synced after that rename and after the conversion's entries moved in; then report.json synced before it
    replaces the old one."""
    out = tmp_path / "out"
    events = _convert_recording(source, out, tmp_path, f"output.format={fmt}")
    synced = [(i, e[1]) for i, e in enumerate(events) if e[0] == "fsync"]
    staged_rename = next(i for i, e in enumerate(events) if e[0] == "replace" and e[1] == str(out / ".staging"))
    committed = [*json.loads((out / "manifest.json").read_text())["files"], "manifest.json"]
    assert len(committed) > 3
    for name in committed:
        assert any(i < staged_rename and path == str(out / ".staging" / name) for i, path in synced), (
            f"{name} was not synced before the commit"
        )
    moved_in = [i for i, e in enumerate(events) if e[0] == "replace" and e[1].startswith(str(out / ".incoming") + "/")]
    assert moved_in and events[moved_in[-1]][1].endswith("manifest.json"), "the manifest moves in last"
    assert any(staged_rename < i < moved_in[0] and path == str(out) for i, path in synced), (
        "the rename of .staging is synced"
    )
    assert any(i > moved_in[-1] and path == str(out) for i, path in synced), "the entries moved in are synced"
    report_in = max(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(out / "report.json"))
    assert (
        any(i < report_in and path == str(out / "report.json.tmp") for i, path in synced)
        and any(i > report_in and path == str(out) for i, path in synced)
    )


@pytest.mark.parametrize(("fmt", "written"), [("rank_local", "rank_2.pt"), ("dcp", "dcp/__2_0.distcp")])
def test_output_fsync_false_syncs_nothing(source: Path, tmp_path: Path, fmt: str, written: str) -> None:
    events = _convert_recording(source, tmp_path / "out", tmp_path, "output.fsync=false", f"output.format={fmt}")
    assert [e for e in events if e[0] == "fsync"] == [] and any(e[0] == "replace" for e in events), (
        "the recording saw the commit's renames"
    )
    assert (tmp_path / "out" / written).is_file()


# ---------------------------------------------------------------------------- crashes


def test_a_kill_anywhere_in_the_commit_leaves_one_whole_conversion_old_or_new(source: Path, tmp_path: Path) -> None:
    """A 3-rank conversion is replaced by a 2-rank one; the command is killed after each rename of its commit in turn
    (and once before the first): once the next run's recovery has run, the directory holds the old conversion or the new
    one, never a mixture."""
    from osdpipe.io.output import recover

    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    results = run_cli_cases(
        [_job(source, 3, old_dir), _job(source, 2, new_dir)], cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env()
    )
    assert [r["code"] for r in results] == [0, 0], results
    old, new = _conversion(old_dir), _conversion(new_dir)
    assert old != new
    seen = []
    for after in range(12):
        work = tmp_path / f"kill_{after}"
        shutil.copytree(old_dir, work)
        result = run_command(
            [sys.executable, "-m", "osdpipe", *_job(source, 2, work)],
            cwd=tmp_path,
            timeout=TIMEOUT_S,
            env=user_env(OSDPIPE_TEST_FAULT=f"commit:{after}"),
        )
        if result.returncode == 0:  # past the last rename: the commit finished
            break
        assert result.returncode == -9, f"commit:{after}: exit {result.returncode}\n{result.stderr}"
        recover(work)
        now = _conversion(work)
        assert now in (old, new), (
            f"killed after rename {after}: a mixture\n{sorted(set(now.items()) ^ set(old.items()))[:6]}"
        )
        assert not [p.name for p in work.iterdir() if p.name.startswith(".")], (
            f"killed after rename {after}: left {list(work.iterdir())}"
        )
        seen.append("new" if now == new else "old")
    assert seen[0] == "old" and seen[-1] == "new" and len(seen) >= 8, f"the kill points did not span the commit: {seen}"
    assert seen == sorted(seen, key=lambda s: s == "new"), f"once the new conversion is committed it stays: {seen}"
