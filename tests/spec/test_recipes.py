"""Every recipe, as its comment says to run it, through the ``osdpipe`` command:
it converts and passes every check it runs.

Above all ``resume``: whatever layout a recipe converts from and to, the
target job that loads its output and steps holds what a job resuming from
the source holds. The report must say which of resume's parts ran (offline,
bare optimizers over the output's tensors play the target).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli_cases

#: End to end: it starts worlds, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
#: The recipes that convert once (sweep_world_sizes is a sweep: tests/cli/test_sweep.py runs it).
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml") if p.stem != "sweep_world_sizes")


def test_every_recipe_converts_and_resumes(tmp_path: Path) -> None:
    cases = [[f"recipe={name}", f"output.path={tmp_path / name}"] for name in RECIPES]
    failed = {}
    for name, result in zip(RECIPES, run_cli_cases(cases, cwd=tmp_path, per_case_s=240)):
        report_path = tmp_path / name / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        checks = {c["name"]: c for c in report.get("checks", [])}
        if result["code"] != 0 or not report.get("ok") or "resume" not in checks:
            failed[name] = result["stderr"] or report
            continue
        resume = checks["resume"]["detail"]
        live = json.loads((tmp_path / name / "manifest.json").read_text())["config"]["runtime"]["mode"] == "online"
        expected = (
            "steps: the "
            if live
            else "steps: bare optimizers over the output's tensors (no live target job: runtime.mode=offline)"
        )
        if not resume.startswith("storage: no two state tensors share memory; " + expected):
            failed[name] = resume
    assert not failed, failed
