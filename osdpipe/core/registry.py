"""The one lookup every registry (kinds, formats, checks) answers with:
a member by name, or an error naming them all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def member(table: Mapping[str, T], name: str, what: str) -> T:
    """``table[name]``.

    Raises:
        ValueError: ``unknown <what> 'x'; the <what>s are a, b, c``.
    """
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; the {what}s are {', '.join(table)}") from None
