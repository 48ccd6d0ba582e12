"""docs/config.md's lists cannot fall behind the registries and ``conf/``.

Its opening paragraph names every config group with its options; the rows of ``model.factory``, ``input.format``,
``output.format`` and ``checkpoint.layout`` name every built-in model, format and checkpoint layout. A member added to
a registry or a file added to ``conf/<group>/`` fails here until the page names it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from osdpipe.io import checkpoints, formats
from osdpipe.layout.models import BUILTIN_MODELS

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "config.md"
#: Groups whose options the page points to elsewhere (recipes have a page of their own: docs/usage.md).
ELSEWHERE = {"recipe"}


def documented_groups(text: str) -> dict[str, set[str]]:
    """The ``Groups (`conf/`): `group` (`a`, `b`), ...`` paragraph, as group -> the options it names."""
    paragraph = " ".join(text.split("Groups (`conf/`):", 1)[1].split("\n\n", 1)[0].split())
    groups: dict[str, set[str]] = {}
    for names, options in re.findall(r"((?:`\w+`(?: and |, )?)+) \(([^()]*)\)", paragraph):
        for group in re.findall(r"`(\w+)`", names):
            groups[group] = set(re.findall(r"`([\w]+)`(?::|,|\)|$| )", options + " "))
    return groups


def row(text: str, key: str) -> str:
    """The meaning column of ``key``'s row."""
    (line,) = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
    return line.split("|")[3]


def named_in(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def conf_groups() -> dict[str, set[str]]:
    return {d.name: {p.stem for p in d.glob("*.yaml")} for d in sorted((REPO / "conf").iterdir()) if d.is_dir()}


def test_every_config_group_and_option_is_on_the_page() -> None:
    documented, actual = documented_groups(PAGE.read_text()), conf_groups()
    for group, options in actual.items():
        if group in ELSEWHERE:
            assert group in documented, f"docs/config.md does not name the config group {group!r}"
            continue
        assert documented.get(group) == options, (
            f"docs/config.md names {sorted(documented.get(group, ()))} for the group {group!r}; conf/{group}/ holds "
            f"{sorted(options)}"
        )
    extra = set(documented) - set(actual)
    assert not extra, f"docs/config.md names groups conf/ does not have: {extra}"


@pytest.mark.parametrize(
    ("key", "members"),
    [
        ("model.factory", sorted(BUILTIN_MODELS)),
        ("input.format", sorted(formats.FORMATS)),
        ("output.format", sorted(n for n, f in formats.FORMATS.items() if f.written)),
        ("checkpoint.layout", sorted(checkpoints.LAYOUTS)),
    ],
)
def test_every_registry_member_is_named_in_its_row(key: str, members: list[str]) -> None:
    missing = [m for m in members if m not in named_in(row(PAGE.read_text(), key))]
    assert not missing, f"docs/config.md's {key} row does not name {missing}"


def test_a_missing_option_fails_the_groups_test(monkeypatch, tmp_path: Path) -> None:
    """The test above can fail: the page with one checkpoint option taken out of its paragraph."""
    text = PAGE.read_text().replace(", `hf`)", ")", 1)
    assert text != PAGE.read_text(), "the page's checkpoint group no longer ends with hf: update this test"
    assert documented_groups(text)["checkpoint"] != conf_groups()["checkpoint"]
