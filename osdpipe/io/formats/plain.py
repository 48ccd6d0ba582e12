"""``plain``: one ``torch.save`` file holding a non-distributed ``optim.state_dict()`` of the unwrapped model.

Its state is keyed by param ID: ``{"state": {id: {...}}, "param_groups": [{..., "params": [ids]}]}``
with full tensors. The reader maps IDs to canonical FQNs (:mod:`osdpipe.layout.idmap`:
by the param groups the user gives, checked by shape, or by shape alone where
that is unambiguous) and then exposes the same FQN-keyed metadata as an
``fsdp_full`` file, so every later stage works unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from osdpipe.io import fetched_memory
from osdpipe.io.formats.base import (
    Format,
    IdGroups,
    InputError,
    RankFiles,
    Shown,
    SourceMeta,
    SourceReader,
    describe_value,
    mapped_range,
    release_mapped,
    write_torch_file,
)
from osdpipe.io.formats.fsdp_full import ONE_FILE, load_full, read_one_file_facts
from osdpipe.layout.idmap import StateShapes, map_ids
from osdpipe.layout.kinds.none import NoWrapper
from osdpipe.layout.ranges import LayoutSpec
from osdpipe.layout.tree import ModuleTree

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts


def saved_ids(osd: dict[str, Any], path: str) -> tuple[list[list[int]], StateShapes]:
    """The ``params`` ID list of each param group, and the shapes of each ID's tensor state.

    Raises:
        InputError: if ``osd`` is not param-ID keyed like ``optim.state_dict()``.
    """
    groups = osd.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise InputError(
            f"{path} has no param groups with 'params' lists; "
            "a plain checkpoint is torch.save(optim.state_dict()) of an unwrapped model"
        )
    keys = [k for g in groups for k in g["params"]] + list(osd["state"])
    named = [k for k in keys if not isinstance(k, int) or isinstance(k, bool)]
    if named:
        raise InputError(
            f"{path} keys its state by {named[0]!r}, not by param ID; "
            "a plain checkpoint is optim.state_dict() of an unwrapped model. "
            "An FQN-keyed full state (FSDP.optim_state_dict) is input.format=fsdp_full"
        )
    shapes = {
        pid: {n: tuple(v.shape) for n, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
        for pid, s in osd["state"].items()
    }
    return [list(g["params"]) for g in groups], shapes


class PlainReader:
    """Reads a ``plain`` file memory-mapped; every rank maps the IDs itself (metadata only) and reads its ranges."""

    def __init__(self, path: str, tree: ModuleTree, id_groups: IdGroups) -> None:
        self.path = path
        self.tree = tree
        self.id_groups = id_groups
        self._osd: dict[str, Any] | None = None
        self._fqn_of: dict[int, str] | None = None
        self._id_of: dict[str, int] = {}

    @property
    def osd(self) -> dict[str, Any]:
        if self._osd is None:
            self._osd = load_full(self.path, "plain")
        return self._osd

    def fqn_of(self) -> dict[int, str]:
        """Param ID -> canonical FQN, every pair checked (see :func:`osdpipe.layout.idmap.map_ids`)."""
        if self._fqn_of is None:
            saved_groups, shapes = saved_ids(self.osd, self.path)
            try:
                self._fqn_of = map_ids(self.tree, saved_groups, shapes, self.id_groups)
            except ValueError as exc:
                raise InputError(f"{self.path} (input.format=plain): {exc}") from None
            self._id_of = {f: i for i, f in self._fqn_of.items()}
        return self._fqn_of

    def meta(self) -> SourceMeta:
        fqn_of, state = self.fqn_of(), self.osd["state"]
        order = [pid for g in self.osd["param_groups"] for pid in g["params"] if pid in state]
        per_param = {fqn_of[pid]: {n: describe_value(v) for n, v in state[pid].items()} for pid in order}
        groups = [{**g, "params": [fqn_of[pid] for pid in g["params"]]} for g in self.osd["param_groups"]]
        return SourceMeta(state=per_param, param_groups=groups)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        return {item: fetched_memory.fetch_all(self._tensor(*item)) for item in items}

    def _tensor(self, fqn: str, name: str) -> torch.Tensor:
        self.fqn_of()  # every rank maps the IDs itself: meta() ran on rank 0 only
        return self.osd["state"][self._id_of[self.tree.canonical(fqn)]][name]

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        return mapped_range(self._tensor(fqn, name), start, stop)

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        release_mapped(self._tensor(fqn, name), start, stop)

    def expect(self, reads: list[tuple[str, str, int, int]]) -> None:
        """The reads to come, told ahead: a file in object storage fetches their pages ahead."""
        fetched_memory.plan([(self._tensor(fqn, name), start, stop) for fqn, name, start, stop in reads])


class Plain(Format):
    """An unwrapped model's ``optim.state_dict()``, keyed by param ID,
    in one file that rank 0 writes (every rank holds it whole)."""

    name = "plain"
    keyed_by_id = True
    directory = False
    generated_name = ONE_FILE
    looks_like = "a torch.save file keyed by param ID"
    made_as_written = True
    source_kind = NoWrapper.name

    def output_path(self, directory: Path, rank: int) -> Path:
        return directory / ONE_FILE

    def refuses_source(self, kind: Any) -> str | None:
        if kind.replicated:
            return None
        return (
            "input.format=plain is the state of an unwrapped model (or a DDP job's, alike on every rank); "
            "set source.kind=none source.world_size=1, or source.kind=ddp"
        )

    def refuses_saved_by(self, kind: Any, path: str) -> str | None:
        """Whole, param-ID keyed state: the files of a job whose every rank holds every parameter whole."""
        if kind is not None and self.refuses_source(kind) is None:
            return None
        return (
            f"{path} is one param-ID keyed state of whole tensors, as an unwrapped model (or every DDP rank) holds it: "
            "set source.kind=none (or ddp)"
        )

    def read_facts(self, facts: Facts, path: Path, key: str | None) -> None:
        read_one_file_facts(facts, path)
        facts.kind, facts.world_size = NoWrapper.name, 1
        facts.notes.append(
            "param-ID keyed, every tensor whole: "
            "an unwrapped model's optim.state_dict(), or a DDP job's (the same on every rank)"
        )

    def shows(self, facts: Facts, kind: Any) -> list[Shown]:
        """A job of one process (an unwrapped model's) saved it: its world size is 1,
        and the sharding keys a recipe may have set for another source go back to their defaults."""
        if kind is None or kind.one_process is None:
            return []
        return [
            Shown("source.world_size", 1, f"{facts.path} is {kind.one_process}"),
            Shown("source.shard_group_size", None),
            Shown("source.sharding_strategy", "FULL_SHARD"),
        ]

    def refuses_target(self, kind: Any) -> str | None:
        if kind.replicated:
            return None
        return (
            f"output.format=plain is the state of a model every rank holds whole; target.kind={kind.name} shards it: "
            "set target.kind=none (and target.world_size=1) or ddp, or another output.format"
        )

    def writes(self, rank: int) -> bool:
        return rank == 0

    def open(self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups) -> SourceReader:
        return PlainReader(path, tree, id_groups)

    def id_groups(self, given: IdGroups, configured: IdGroups, generated: bool) -> IdGroups:
        # osdpipe built the source's optimizer from optim.param_groups (one group over model.parameters() without)
        if given is None and generated:
            return configured or [["*"]]
        return given

    def write(
        self,
        result: dict[str, Any],
        staging: Path,
        rank: int,
        *,
        key: str,
        tree: ModuleTree,
        world_size: int,
        shared: dict[str, Any],
    ) -> RankFiles:
        return write_torch_file(result, staging / ONE_FILE)

    def load_as_a_user_does(self, model: Any, optim: Any, path: Path, written: dict[str, Any], kind: Any) -> None:
        optim.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
