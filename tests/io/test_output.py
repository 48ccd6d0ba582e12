"""The output directory: a conversion replaces the previous one whole, even when interrupted at any point."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from osdpipe.io import output

OLD = {
    "rank_0.pt": "old0", "rank_1.pt": "old1", "rank_2.pt": "old2",
    "manifest.json": "old", "source/rank_local/rank_0.pt": "oldsrc",
}
NEW = {"rank_0.pt": "new0", "rank_1.pt": "new1", "manifest.json": "new", "source/optim.pt": "newsrc"}


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def read_tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the run's own record (report.json) and user files."""
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in ("report.json", "notes.txt")
    }


def prepared(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    write_tree(out, OLD)
    (out / "notes.txt").write_text("the user's own file")
    staging = output.begin(out)
    write_tree(staging, NEW)
    return out


class Interrupted(Exception):
    pass


def count_moves(tmp_path: Path) -> int:
    out = prepared(tmp_path / "count")
    calls = 0
    real = os.replace

    def counting(src, dst):
        nonlocal calls
        calls += 1
        return real(src, dst)

    output.os.replace = counting
    try:
        output.commit(out)
    finally:
        output.os.replace = real
    assert read_tree(out) == NEW
    return calls


def test_commit_replaces_the_previous_conversion_whole(tmp_path: Path) -> None:
    out = prepared(tmp_path)
    output.commit(out)
    assert read_tree(out) == NEW, "a file of the previous conversion stayed"
    assert (out / "notes.txt").read_text() == "the user's own file", "a file osdpipe did not write was touched"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_an_interrupted_commit_recovers_to_old_or_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moves = count_moves(tmp_path)
    assert moves >= len(OLD) + 1
    outcomes = set()
    for stop_after in range(moves):
        out = prepared(tmp_path / f"stop{stop_after}")
        real = os.replace
        calls = 0

        def dying(src, dst, real=real):
            nonlocal calls
            if calls == stop_after:
                raise Interrupted
            calls += 1
            return real(src, dst)

        monkeypatch.setattr(output.os, "replace", dying)
        with pytest.raises(Interrupted):
            output.commit(out)
        monkeypatch.setattr(output.os, "replace", real)
        output.recover(out)  # what the next run into this directory does first
        tree = read_tree(out)
        assert tree in (OLD, NEW), f"interrupted after {stop_after} moves: a mix {tree}"
        outcomes.add("new" if tree == NEW else "old")
        assert (out / "notes.txt").exists()
    assert outcomes == {"old", "new"}  # before the first rename the old one stays; after it, the new one is finished


def test_a_failed_run_leaves_the_previous_conversion(tmp_path: Path) -> None:
    out = prepared(tmp_path)
    output.abort(out)
    assert read_tree(out) == OLD
