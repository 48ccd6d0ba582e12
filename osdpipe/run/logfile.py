"""``osdpipe.log`` in the output directory: what ran, one line per fact, at ``runtime.log_level`` and above.

Written by the launcher when the run ends, from the run's report, so it says
the same as ``report.json`` in lines a person reads or greps: the conversion
and how it ran, each stage's seconds and bytes, each check, what was skipped
and why, warnings, the error; at ``debug``, also each process's memory, each
file's sha256 and the traceback. Like ``report.json`` it is written on failure
too, and is not part of the conversion's hashed content.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from osdpipe.core.sizes import show_size
from osdpipe.core.version import __version__
from osdpipe.io.output import write_durably

#: Level names as ``runtime.log_level`` takes them, lowest first.
LEVELS = ("debug", "info", "warning", "error")
LOG_NAME = "osdpipe.log"


def log_lines(report: Any, spec: Any) -> Iterator[tuple[str, str]]:
    """``(level, line)`` for everything the run's report says, in the order it happened."""
    rt = spec.runtime
    budget = "none" if rt.memory_budget is None else show_size(rt.memory_budget)
    yield "info", (
        f"osdpipe {__version__}: {spec.source.kind} on {spec.source.world_size} rank(s) -> "
        f"{spec.target.kind} on {spec.target.world_size}, output {spec.output.format} at {spec.output.path}"
    )
    yield "info", (
        f"input {spec.input.path or '(generated)'} ({spec.input.format}); "
        f"mode {rt.mode}, transfer {rt.transfer}, memory budget {budget}"
    )
    for s in report.stages:
        yield "info", (
            f"stage {s.name}: {s.seconds:.3f} s, {s.bytes:,d} B read or written, {s.sent:,d} B sent to other ranks"
        )
    for c in report.checks:
        yield ("info" if c.ok else "error"), f"check {c.name}: {'pass' if c.ok else 'FAIL'}: {c.detail}"
    for c in report.skipped_checks:
        yield "info", f"check {c.name} did not run: it {c.why}"
    for w in report.warnings:
        yield "warning", w
    for m in report.memory:
        anon = (
            "unknown"
            if m.peak_anonymous is None
            else f"{m.peak_anonymous:,d} B (baseline {m.baseline_anonymous or 0:,d} B)"
        )
        yield "debug", f"memory of {m.process}: peak RSS {m.peak_rss:,d} B, peak anonymous {anon}"
    for name, digest in sorted(report.files.items()):
        yield "debug", f"file {name} digest {digest}"
    if report.ok:
        yield "info", "ok: every stage ran and every check passed"
    else:
        yield "error", f"failed: {report.failure}"
        if report.traceback:
            yield "debug", report.traceback.rstrip()


def write_log(directory: str | Path, report: Any, spec: Any) -> Path:
    """Write ``osdpipe.log`` into ``directory``: the lines at ``spec.runtime.log_level`` and above."""
    floor = LEVELS.index(spec.runtime.log_level)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    lines = [
        f"{stamp} {level.upper():<7} {line}" for level, line in log_lines(report, spec) if LEVELS.index(level) >= floor
    ]
    path = Path(directory) / LOG_NAME
    write_durably(path, "\n".join(lines) + "\n", spec.output.fsync)
    return path
