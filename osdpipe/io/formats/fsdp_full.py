"""``fsdp_full``: one ``torch.save`` file holding the FQN-keyed full optimizer state dict."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from osdpipe.io import fetched_memory
from osdpipe.io.formats.base import (
    Format,
    IdGroups,
    InputError,
    RankFiles,
    SourceMeta,
    SourceReader,
    describe_value,
    mapped_range,
    release_mapped,
    write_torch_file,
)
from osdpipe.io.formats.safe_load import load_torch_file
from osdpipe.io.formats.state_facts import Unit, describe_state, moments_alike, tally
from osdpipe.layout.kinds.fsdp1 import FSDP1
from osdpipe.layout.ranges import LayoutSpec, LocalTensor, full_layout
from osdpipe.layout.tree import ModuleTree

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts


def load_full(path: str, fmt: str = "fsdp_full") -> dict[str, Any]:
    """Load a full optimizer state dict (``fsdp_full`` or ``plain``), memory-mapped so that only touched bytes are read.

    Raises:
        InputError: the file is missing, damaged, unsafe (see :func:`~osdpipe.io.formats.safe_load.load_torch_file`),
            or holds something other than an optimizer state dict.
    """
    osd = load_torch_file(path)
    check_optim_state_dict(osd, path, fmt)
    return osd


def check_optim_state_dict(osd: Any, path: str | Path, fmt: str) -> None:
    """Refuse, in one line, a loaded object that is not an optimizer state dict
    ``{"state": {...}, "param_groups": [...]}``."""
    if not isinstance(osd, dict):
        raise InputError(f"{path} holds a {type(osd).__name__}, not an optimizer state dict; {_WANTED[fmt]}")
    if not isinstance(osd.get("state"), dict):
        keys = [str(k) for k in list(osd)[:4]]
        looks = (
            ": it looks like a model's state_dict()" if osd and all(torch.is_tensor(v) for v in osd.values()) else ""
        )
        raise InputError(
            f"{path} is not an optimizer state dict (no 'state' dict; its keys are {keys}){looks}; {_WANTED[fmt]}"
        )
    groups = osd.get("param_groups")
    if groups is None and fmt != "plain":
        return
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise InputError(
            f"{path} is not an optimizer state dict: its 'param_groups' is not a list of groups with 'params' lists; "
            f"{_WANTED[fmt]}"
        )
    if fmt != "fsdp_full":  # param-ID keyed: every ID's state is a dict (an FQN-keyed file may carry other user state)
        bad = next(((k, v) for k, v in osd["state"].items() if isinstance(k, int) and not isinstance(v, dict)), None)
        if bad is not None:
            raise InputError(
                f"{path} is not an optimizer state dict: "
                f"the state of param ID {bad[0]} is a {type(bad[1]).__name__}, not a dict; {_WANTED[fmt]}"
            )


_WANTED = {
    "fsdp_full": (
        "an fsdp_full input is torch.save(FSDP.optim_state_dict(model, optim)) with FULL_STATE_DICT: "
        "point input.path at it"
    ),
    "plain": "a plain input is torch.save(optim.state_dict()) of an unwrapped model: point input.path at it",
    "rank_local": (
        "a rank_local file is torch.save(optim.state_dict()) of that rank: point input.path at the directory of them"
    ),
}


class FullReader:
    """Reads an ``fsdp_full`` file; every rank maps the same file and touches only its ranges."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._osd: dict[str, Any] | None = None

    @property
    def osd(self) -> dict[str, Any]:
        if self._osd is None:
            self._osd = load_full(self.path)
        return self._osd

    def meta(self) -> SourceMeta:
        state = self.osd["state"]
        if any(isinstance(pid, int) for g in self.osd.get("param_groups") or [] for pid in g.get("params", [])):
            raise InputError(
                f"{self.path} keys its state by param ID, as an unwrapped model's optim.state_dict() does, not by FQN; "
                "read it as input.format=plain source.kind=none source.world_size=1"
            )
        per_param = {
            k: {n: describe_value(v) for n, v in s.items()}
            for k, s in state.items()
            if isinstance(k, str) and isinstance(s, dict)
        }
        extra = {k: v for k, v in state.items() if k not in per_param}
        return SourceMeta(state=per_param, param_groups=self.osd.get("param_groups"), extra=extra)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        state = self.osd["state"]
        return {(fqn, name): fetched_memory.fetch_all(state[fqn][name]) for fqn, name in items}

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        return mapped_range(self.osd["state"][fqn][name], start, stop)

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        release_mapped(self.osd["state"][fqn][name], start, stop)

    def expect(self, reads: list[tuple[str, str, int, int]]) -> None:
        """The reads to come, told ahead: a file in object storage fetches their pages ahead."""
        state = self.osd["state"]
        fetched_memory.plan([(state[fqn][name], start, stop) for fqn, name, start, stop in reads])


#: The one file of a ``fsdp_full`` or ``plain`` checkpoint.
ONE_FILE = "optim.pt"


def read_one_file_facts(facts: Facts, path: Path) -> dict[Any, dict[str, Any]]:
    """What an ``fsdp_full`` or ``plain`` file
    (one ``torch.save`` of a whole optimizer state dict) shows of its state; the state, each parameter's."""
    osd = load_full(str(path), facts.format)
    state = {k: v for k, v in osd["state"].items() if isinstance(v, dict)}
    describe_state(facts, state, osd.get("param_groups"))
    tally(facts, state)
    facts.params = len(state)
    facts.moments_alike = moments_alike(state)
    return state


def _shared_step_units(state: dict[str, dict[str, Any]]) -> list[Unit]:
    """FSDP1 units, from the ``step`` tensor a FULL state shares across each unit's parameters
    (``torch.save`` keeps the sharing)."""
    units: dict[int, Unit] = {}
    for fqn, entry in state.items():
        step = entry.get("step")
        if not torch.is_tensor(step):
            continue
        numel = max((v.numel() for v in entry.values() if torch.is_tensor(v) and v.dim() > 0), default=0)
        unit = units.setdefault(step.untyped_storage().data_ptr(), Unit([], 0))
        unit.fqns.append(fqn)
        unit.numel += numel
    return list(units.values())


class FsdpFull(Format):
    """The full FQN-keyed state, every parameter whole,
    in one file that rank 0 writes (``FSDP.optim_state_dict``, FULL)."""

    name = "fsdp_full"
    keyed_by_id = False
    directory = False
    generated_name = ONE_FILE
    looks_like = "a torch.save file keyed by FQN"
    made_as_written = True

    def output_path(self, directory: Path, rank: int) -> Path:
        return directory / ONE_FILE

    def writes(self, rank: int) -> bool:
        return rank == 0

    def output_layout(
        self, tree: ModuleTree, target: LayoutSpec, rank: int, optimizer_layout: Callable[[], tuple[LocalTensor, ...]]
    ) -> tuple[LocalTensor, ...]:
        return full_layout(tree) if rank == 0 else ()

    def open(self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups) -> SourceReader:
        return FullReader(path)

    def read_facts(self, facts: Facts, path: Path, key: str | None) -> None:
        """FQN-keyed and whole, as any kind of job saves it;
        FSDP1's FULL state also shares one ``step`` tensor across each unit's parameters."""
        state = read_one_file_facts(facts, path)
        facts.fqns = sorted(map(str, state))
        facts.units = _shared_step_units(state)
        if any(len(u.fqns) > 1 for u in facts.units):
            facts.kind = FSDP1.name
            facts.notes.append(
                f"FSDP1's FULL state: {len(facts.units)} unit(s), each sharing one step tensor across its parameters; "
                "the world size that saved it is not recorded in a full state dict"
            )
        else:
            facts.units = []
            facts.notes.append(
                "a full, FQN-keyed state: any kind of job can save one; "
                "it does not record the world size or the wrapping"
            )

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
