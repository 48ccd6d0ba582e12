"""``ruff check osdpipe tests benchmarks`` is clean with the project's own config (pyproject.toml ``[tool.ruff]``).

pyflakes' rules find a name nobody defined before a user does (a ``NameError`` in ``osdpipe check``'s accelerate path
once shipped); pycodestyle's hold lines to 120 characters; the import order is isort's. The linter is in the ``test``
extra, so CI runs it through this test. The benchmarks are linted too: they are run rarely, by hand, and a name
nobody defined there shows only on the day a table is due.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    """The linter the ``test`` extra installs: missing, the test fails (a skipped lint would pass unseen)."""
    found = shutil.which("ruff")
    assert found is not None, "ruff is not installed: pip install -e '.[test]'"
    return [found]


def test_ruff_check_is_clean() -> None:
    done = subprocess.run(
        [*_ruff(), "check", "osdpipe", "tests", "benchmarks"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_ruff_finds_a_name_nobody_defined(tmp_path: Path) -> None:
    """The check can fail: a module that uses an undefined name is reported with the project's config."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    return model_state_dict\n")
    done = subprocess.run(
        [*_ruff(), "check", "--config", str(REPO / "pyproject.toml"), str(planted)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1 and "F821" in done.stdout, done.stdout


def test_no_line_of_the_package_is_longer_than_120_characters() -> None:
    """ruff measures a line without a trailing pragma (``# noqa``); the package's lines hold the limit whole."""
    long = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "osdpipe").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 120
    ]
    assert long == [], f"lines over 120 characters: {long[:10]}"
