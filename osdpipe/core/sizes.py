"""Sizes in bytes as people write them (``512MB``, ``2GB``, ``1.5GiB``) and read them:
pure, so any command can use them cheaply."""

from __future__ import annotations

from typing import Any

_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(value: Any) -> int | None:
    """A size as bytes: an int, or a string such as ``512MB``, ``2GB``, ``1.5GiB`` (``None`` stays ``None``).

    Raises:
        ValueError: naming the value and the forms it may take.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    text = str(value).strip().upper().replace(" ", "")
    number = text.rstrip("KMGTIB")
    unit = text[len(number) :] or "B"
    try:
        if unit in _UNITS and float(number) >= 0:
            return int(float(number) * _UNITS[unit])
    except ValueError:
        pass
    raise ValueError(f"{value!r} is not a size; write bytes or a number with a unit: 512MB, 2GB, 1.5GiB")


def show_size(n: int) -> str:
    """Bytes as a person reads them, in the units :func:`parse_size` takes: ``1.61GB``, ``512MB``, ``1KB``."""
    for unit in ("TB", "GB", "MB", "KB"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.3g}{unit}"
    return f"{n}B"
