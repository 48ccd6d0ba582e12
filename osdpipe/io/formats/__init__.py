"""Checkpoint formats: the registry, one module per format (design.md section 4).

Each format module declares a :class:`~osdpipe.io.formats.base.Format`: its
reader, its writer, the file each target rank loads, how it keys state, and
what its files show of themselves (:mod:`osdpipe.io.file_facts`) and settle of a
user's description of them (:mod:`osdpipe.spec.reconcile`).
:data:`FORMATS` lists them; everything else asks it (:func:`get`) and never
compares a format's name.

A reader exposes a source checkpoint as FQN-keyed, full per-parameter state:
cheap metadata first (:class:`SourceMeta`), then tensor bytes on demand, so a
rank reads only the parameters its target shard touches.

Every input is read as data nobody vouches for (:mod:`osdpipe.io.formats.safe_load`):
no pickle in it can run code, and a damaged or wrong input is refused with an
:class:`InputError`, one line that names the file, what is wrong and what to do.
:func:`inspect_source` runs every check that needs no process group, so the
launcher can refuse a bad input before any process starts.
"""

from __future__ import annotations

from osdpipe.core.registry import member
from osdpipe.io.formats.base import (
    Format,
    IdGroups,
    InputError,
    RenamedReader,
    SourceMeta,
    SourceReader,
    TensorRef,
    describe_value,
    full_state,
    local_part,
    mapped_range,
    own_copy,
    release_mapped,
)
from osdpipe.io.formats.dcp import Dcp
from osdpipe.io.formats.deepspeed import DeepSpeed
from osdpipe.io.formats.fsdp_full import FsdpFull
from osdpipe.io.formats.megatron_source import Megatron
from osdpipe.io.formats.meta import canonical_meta
from osdpipe.io.formats.plain import Plain
from osdpipe.io.formats.rank_local import RankLocal
from osdpipe.io.formats.safe_load import first_line
from osdpipe.io.formats.safetensors import Safetensors
from osdpipe.io.formats.verl import Verl
from osdpipe.layout.ranges import LayoutSpec
from osdpipe.layout.tree import ModuleTree

__all__ = [
    "FORMATS", "Format", "get", "IdGroups", "InputError", "RenamedReader", "SourceMeta", "SourceReader", "TensorRef",
    "canonical_meta", "describe_value", "full_state", "inspect_source", "local_part", "mapped_range", "open_source",
    "own_copy", "release_mapped",
]


#: Every format, by name: the only place that lists them.
FORMATS: dict[str, Format] = {
    f.name: f for f in (FsdpFull(), Dcp(), Plain(), RankLocal(), Verl(), DeepSpeed(), Megatron(), Safetensors())
}


def get(name: str) -> Format:
    """The format called ``name``.

    Raises:
        ValueError: naming the formats there are.
    """
    return member(FORMATS, name, "format")


def open_source(
    fmt: str, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups,
    described: bool = False,
) -> SourceReader:
    """A reader for the checkpoint at ``path`` in format ``fmt``; ``described``: for its metadata alone
    (:meth:`~osdpipe.io.formats.base.Format.describe`).

    Args:
        fmt: the input format.
        path: the file or directory.
        key: the top-level key of a DCP checkpoint.
        tree: the model's module tree (param-ID keyed formats map IDs to it).
        source: the layout the checkpoint was saved under.
        id_groups: for param-ID keyed formats, the FQN patterns of each param
            group of the optimizer that saved it (``None``: not given).
    """
    if fmt not in FORMATS:
        raise ValueError(f"input.format={fmt!r} cannot be read; use {', '.join(FORMATS)}")
    opened = FORMATS[fmt].describe if described else FORMATS[fmt].open
    return opened(path, key, tree=tree, source=source, id_groups=id_groups)


def inspect_source(
    fmt: str, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups
) -> SourceMeta:
    """Open the checkpoint and run every check that needs no process group; its canonical metadata.

    What the launcher calls before it starts any process, so that a damaged or
    wrong input fails in one line at once rather than in every rank of a
    world. It reads metadata only: the files' structure (zip indexes, DCP
    metadata, the size of every file the metadata names), the pickles, and
    the small state DCP keeps as bytes (param groups, ``step``); tensor bytes
    stay memory-mapped or unread, as the readers leave them. The arguments are
    those of :func:`open_source`.

    Raises:
        InputError: the input is damaged, unsafe, or does not fit the model
            and the source layout.
        ValueError: the config cannot describe this input (e.g. ``input.param_groups``
            that match no parameter); the message says which key to mend.
    """
    try:
        reader = open_source(fmt, path, key, tree=tree, source=source, id_groups=id_groups, described=True)
        return canonical_meta(reader.meta(), tree, where=path)
    except ValueError:
        raise
    except Exception as exc:  # a reader tripping over structure it did not expect: still the input's fault
        raise InputError(
            f"{path} could not be read as input.format={fmt} ({first_line(exc)}); "
            "it may be damaged or in another format: "
            "re-copy it or point input.path and input.format at the right checkpoint"
        ) from exc
