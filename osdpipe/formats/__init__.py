"""Checkpoint formats: one reader and one writer per format (design.md section 4).

A reader exposes a source checkpoint as FQN-keyed, full per-parameter state:
cheap metadata first (:class:`SourceMeta`), then tensor bytes on demand, so a
rank reads only the parameters its target shard touches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from osdpipe.layout import LayoutSpec
from osdpipe.tree import ModuleTree

#: Param groups of the optimizer that saved a param-ID keyed checkpoint, as FQN patterns per group.
IdGroups = list[list[str]] | None


@dataclass(frozen=True)
class TensorRef:
    """A positive-dimension state tensor, described without its bytes."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class SourceMeta:
    """What every rank needs to know about the source: small, broadcast from rank 0.

    Attributes:
        state: FQN -> state name -> :class:`TensorRef` for positive-dimension
            tensors, or the value itself (0-dim tensors such as Adam's ``step``,
            floats, ``None``).
        param_groups: the FQN-keyed param groups, or ``None`` when absent.
        extra: top-level ``state`` entries that name no parameter (user state).
    """

    state: dict[str, dict[str, Any]]
    param_groups: list[dict[str, Any]] | None
    extra: dict[str, Any] = field(default_factory=dict)


def describe_value(value: Any) -> Any:
    """A state value as metadata: positive-dim tensors become :class:`TensorRef`, the rest stays."""
    if torch.is_tensor(value) and value.dim() > 0:
        return TensorRef(tuple(value.shape), str(value.dtype).removeprefix("torch."))
    return value


class SourceReader(Protocol):
    """A source checkpoint, read lazily."""

    def meta(self) -> SourceMeta:
        """The checkpoint's metadata (called on one rank, then broadcast)."""
        ...

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        """The full tensors of state ``name`` of parameter ``fqn`` for each ``(fqn, name)``."""
        ...


def open_source(fmt: str, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups) -> SourceReader:
    """A reader for the checkpoint at ``path`` in format ``fmt``.

    Args:
        fmt: the input format.
        path: the file or directory.
        key: the top-level key of a DCP checkpoint.
        tree: the model's module tree (param-ID keyed formats map IDs to it).
        source: the layout the checkpoint was saved under.
        id_groups: for param-ID keyed formats, the FQN patterns of each param
            group of the optimizer that saved it (``None``: not given).
    """
    if fmt == "fsdp_full":
        from osdpipe.formats.fsdp_full import FullReader

        return FullReader(path)
    if fmt == "dcp":
        from osdpipe.formats.dcp import DcpReader

        return DcpReader(path, key)
    if fmt == "plain":
        from osdpipe.formats.plain import PlainReader

        return PlainReader(path, tree, id_groups)
    if fmt == "rank_local":
        from osdpipe.formats.rank_local import RankLocalReader

        return RankLocalReader(path, tree, source, id_groups)
    raise ValueError(f"input.format={fmt!r} cannot be read; use fsdp_full, dcp, plain or rank_local")
