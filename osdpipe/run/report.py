"""What a run says of itself: ``report.json``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from osdpipe.core.memory import MemoryPeak
from osdpipe.io.output import write_durably
from osdpipe.run.products import CheckResult, SkippedCheck


@dataclass
class StageReport:
    """One stage: its seconds (the slowest rank's),
    the bytes its ranks read or wrote, and those they sent each other."""

    name: str
    seconds: float
    bytes: int
    # through the process group: metadata in broadcast, tensor bytes in shard with runtime.transfer=scatter
    sent: int = 0


@dataclass
class Report:
    """What ``report.json`` holds. ``ok`` is true exactly when every stage ran and every check passed."""

    ok: bool
    stages: list[StageReport] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    # configured checks that did not run, and why
    skipped_checks: list[SkippedCheck] = field(default_factory=list)
    error: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # each rank's (offline: the process's) peak memory, in bytes
    memory: list[MemoryPeak] = field(default_factory=list)
    # runtime.memory_budget: bytes a rank may hold in flight (beyond its output where it must hold that)
    memory_budget: int | None = None
    # each rank's (offline: each target rank's) converted tensor bytes
    output_bytes: list[int] = field(default_factory=list)
    # a whole checkpoint's every entry and what became of it (osdpipe.io.checkpoints.base.fates)
    entries: list[dict[str, Any]] = field(default_factory=list)
    # where ``error`` was raised, for runtime.debug and bug reports
    traceback: str | None = None
    # false: ``error`` is this rank's own (under torchrun: it lost another rank, or was stopped),
    # not one every rank raised
    agreed: bool = True

    def __post_init__(self) -> None:
        # A failed check fails the run as surely as a stage does:
        # report.json names it in ``error`` too, in the line the command prints.
        if not self.ok and self.error is None:
            self.error = self.failure

    @property
    def failure(self) -> str | None:
        """Why the run failed, in one line (``None`` when it did not)."""
        if self.ok:
            return None
        if self.error:
            return self.error
        failed = [c for c in self.checks if not c.ok]
        return "verify failed: " + "; ".join(f"check {c.name}: {c.detail}" for c in failed)

    @classmethod
    def unfinished(cls) -> Report:
        """What ``report.json`` says while a run is under way, and after one that died without a word."""
        return cls(
            ok=False,
            error=(
                "the run did not finish: the launcher (under torchrun, rank 0) ended before writing its report; "
                "see the command's output"
            ),
        )

    def write(self, directory: str | Path, durable: bool = True) -> Path:
        """Write ``report.json`` whole into ``directory`` (:func:`osdpipe.io.output.write_durably`):
        the old report or this one, never a part."""
        path = Path(directory) / "report.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(path, json.dumps(asdict(self), indent=2), durable)
        return path
