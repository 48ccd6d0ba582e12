"""Where each leaf of a nested state dict sits, named as ``dcp.save`` names it, and putting a leaf back at its path.

A carried entry of a whole checkpoint is read from one framework's nested state and written into another's DCP
directory, where its name must be the one ``dcp.save`` gives it, and read back into the nest a job loads. These are
the two halves of that, pure, on plain containers: osdpipe's own, so that no product module leans on
``torch.distributed.checkpoint``'s private helpers for them.

The naming, as ``dcp.save`` does it (tests/core/test_state_paths.py saves with it and compares):

* a mapping is walked, each key as ``str(key)``;
* a list is walked, each item by its index, only where it holds a tensor or a mapping or list that is walked;
  otherwise it is one leaf (a list of numbers, a param group's ``betas``);
* anything else is a leaf (a tuple too);
* a leaf's name is its path joined by dots.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: A leaf's path in a nested state: mapping keys (strings) and list indices.
Path = tuple[str | int, ...]


def walked(value: Any) -> bool:
    """Whether ``value`` is a container whose items are leaves of their own, not one leaf."""
    if isinstance(value, Mapping):
        return True
    if not isinstance(value, list):
        return False
    return any(torch.is_tensor(item) or walked(item) for item in value)


def leaf_paths(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Path]]:
    """``(flat, paths)``: every leaf of ``state`` by its dotted name, and each name's path in ``state``.

    Raises:
        ValueError: two leaves share a dotted name (keys that hold dots themselves), which a DCP directory cannot
            hold apart.
    """
    flat: dict[str, Any] = {}
    paths: dict[str, Path] = {}

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit((*path, str(key)), item)
        elif isinstance(value, list) and walked(value):
            for index, item in enumerate(value):
                visit((*path, index), item)
        else:
            name = ".".join(str(p) for p in path)
            if name in flat:
                raise ValueError(f"two entries of the state are both named {name!r} once flattened")
            flat[name], paths[name] = value, path

    for key, value in state.items():
        visit((str(key),), value)
    return flat, paths


def put_at(root: dict[str, Any], path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` in ``root``, making each container on the way that is not there yet: a dict under
    a string key, a list under an index (grown with ``None`` up to it)."""
    container: Any = root
    for step, following in zip(path, path[1:]):
        made: Any = {} if isinstance(following, str) else []
        if isinstance(container, list):
            container.extend([None] * (step + 1 - len(container)))
            if container[step] is None:
                container[step] = made
            container = container[step]
        else:
            container = container.setdefault(step, made)
    last = path[-1]
    if isinstance(container, list):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value
