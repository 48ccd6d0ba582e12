"""The ``osdpipe`` command: compose the config with Hydra, validate it, launch. Nothing else.

Hydra lives only here, in the launcher process; ranks receive the validated
:class:`~osdpipe.config.RunSpec`.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from osdpipe.config import ConfigError, validate
from osdpipe.pipeline import Report, execute

_failed_jobs: list[str] = []

# Under torchrun every rank composes the config; only rank 0 keeps Hydra's record (.hydra/).
OmegaConf.register_new_resolver("osdpipe_hydra_subdir", lambda: ".hydra" if _rank() == 0 else None, replace=True)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def summarize(report: Report, output: str) -> str:
    """A short human summary of a run for the terminal."""
    lines = [f"osdpipe: {'OK' if report.ok else 'FAILED'}  ->  {output}"]
    if report.error:
        lines.append(f"  error: {report.error}")
    lines.extend(f"  warning: {w}" for w in report.warnings)
    for s in report.stages:
        lines.append(f"  {s.name:<10} {s.seconds:8.3f} s  {s.bytes:>12,d} B")
    for c in report.checks:
        lines.append(f"  check {c.name:<10} {'pass' if c.ok else 'FAIL'}  {c.detail}")
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://osdpipe.conf", config_name="config")
def run(cfg: DictConfig) -> bool:
    """One Hydra job: one conversion. Returns whether it succeeded (a sweep goes on after a failure)."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    try:
        spec = validate(raw)  # type: ignore[arg-type]
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"osdpipe: config error: {line}", file=sys.stderr)
        _failed_jobs.append("config")
        return False
    report = execute(spec)
    if _rank() == 0:
        print(summarize(report, spec.output.path), flush=True)
    if not report.ok:
        _failed_jobs.append(spec.output.path)
    return report.ok


def main() -> None:
    """Console entry point: exit 0 exactly when every job succeeded (2 for a bad config, 1 for a failed run)."""
    run()
    if _failed_jobs:
        sys.exit(2 if all(job == "config" for job in _failed_jobs) else 1)


if __name__ == "__main__":
    main()
