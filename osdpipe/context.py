"""What one rank knows while the stages run: the spec, the world, and each stage's product."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from osdpipe.config import RunSpec
from osdpipe import formats
from osdpipe.formats import Format, SourceMeta, SourceReader
from osdpipe.kinds import rank_layout
from osdpipe.layout import LocalTensor
from osdpipe.optim import group_members
from osdpipe.transfer import Source
from osdpipe.tree import ModuleTree
from osdpipe.world import World


@dataclass
class CheckResult:
    """One verify check: its name, whether it passed, and what it saw."""

    name: str
    ok: bool
    detail: str


@dataclass
class SkippedCheck:
    """A verify check that did not run on this conversion, and why (``report.json`` lists them)."""

    name: str
    why: str


@dataclass
class Context:
    """Per-rank state of a pipeline run. Each stage reads what earlier stages left here."""

    spec: RunSpec
    rank: int
    world: World
    tree: ModuleTree
    input_path: str
    input_format: str
    reader: SourceReader | None = None  # load
    meta: SourceMeta | None = None  # broadcast
    flat_state: dict[str, dict[str, Any]] = field(default_factory=dict)  # flatten: key -> name -> TensorRef | value
    local_state: dict[str, dict[str, Any]] = field(default_factory=dict)  # shard: key -> name -> tensor | value
    result: dict[str, Any] | None = None  # rekey: the state dict this rank's output holds
    result_keys: dict[str, Any] = field(default_factory=dict)  # rekey: layout key -> key in result["state"]
    checks: list[CheckResult] = field(default_factory=list)  # verify
    skipped_checks: list[SkippedCheck] = field(default_factory=list)  # verify: the configured checks that did not run, and why
    warnings: list[str] = field(default_factory=list)  # what the user should know though nothing failed
    live: tuple[Any, Any] | None = None  # verify: the real target model and optimizer, built once
    optim_groups: list[list[int]] | None = None  # the live target optimizer's groups (Python API), as layout indices
    optimizer_keys: dict[int, set[str]] = field(default_factory=dict)  # verify: per target rank, the keys its optimizer holds
    bytes_moved: int = 0  # reset per stage
    bytes_sent: int = 0  # reset per stage: bytes this rank sent to others through the process group
    reading_ranks: list[int] | None = None  # load: per rank, the rank that reads its ranges of the input (None: each reads its own)
    sent_digests: dict[int, dict[tuple[str, str, int], str]] = field(default_factory=dict)  # shard, scatter: per receiver, each batch's sha256
    saved: Any = None  # save: this rank's RankFiles, committed after the last rank (osdpipe.loop)
    shared: dict[str, Any] = field(default_factory=dict)  # products the same for every target rank this process plays (offline: all of them), made once
    _optimizer_layouts: dict[int, tuple[LocalTensor, ...]] = field(default_factory=dict, repr=False)
    _output_layouts: dict[int, tuple[LocalTensor, ...]] = field(default_factory=dict, repr=False)

    def nonfinite_in_source(self, found: list[str], *, here: bool = True) -> None:
        """Act on NaN or Inf found in the source (``found`` names each parameter and state).

        By default that is an error, raised where it was found (``here``; the
        other ranks learn of it when the stage's ranks agree). With
        ``input.allow_nonfinite`` it is a warning, and the state converts as it is.
        """
        if not found:
            return
        shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        if self.spec.input.allow_nonfinite:
            self.warnings.append(f"the source holds NaN or Inf, converted as they are (input.allow_nonfinite=true): {shown}")
        elif here:
            raise ValueError(f"the source holds NaN or Inf: {shown}; mend the checkpoint, or set input.allow_nonfinite=true to convert them as they are")

    @property
    def reads_itself(self) -> bool:
        """Whether this rank reads its ranges of the input (else a reading rank sends them: ``runtime.transfer=scatter``)."""
        return self.reading_ranks is None or self.reading_ranks[self.rank] == self.rank

    @property
    def first_reader(self) -> int:
        """The lowest rank that reads the input: it describes the source to the others."""
        return 0 if self.reading_ranks is None else min(self.reading_ranks)

    def receivers(self) -> list[int]:
        """The ranks this rank reads for, besides itself, in rank order."""
        if self.reading_ranks is None:
            return []
        return [r for r, reader in enumerate(self.reading_ranks) if reader == self.rank and r != self.rank]

    def source(self) -> Source:
        """This rank's reader, with the piece size ``runtime.memory_budget`` allows."""
        assert self.reader is not None, "the load stage opens the reader"
        return Source(self.reader, self.spec.runtime.piece_bytes)

    def target_groups(self, layout: tuple[LocalTensor, ...]) -> list[list[int]]:
        """This rank's target optimizer's param groups as indices into ``layout``.

        A live optimizer's own groups (given through the Python API) win;
        otherwise they follow ``optim.param_groups``.
        """
        if self.optim_groups is not None:
            return self.optim_groups
        return group_members(self.spec.optim, layout)

    @property
    def output_format(self) -> Format:
        return formats.get(self.spec.output.format)

    @property
    def id_keyed(self) -> bool:
        """Whether the output is keyed by the target optimizer's param IDs (else by FQN)."""
        return self.output_format.keyed_by_id

    @property
    def world_size(self) -> int:
        return self.world.size

    def held_keys(self, rank: int) -> set[str]:
        """The layout keys target rank ``rank``'s optimizer holds (verify gathers them; offline, computed once per rank asked)."""
        if rank not in self.optimizer_keys:
            layout = self.target_layout(rank)
            self.optimizer_keys[rank] = {layout[i].key for g in self.target_groups(layout) for i in g}
        return self.optimizer_keys[rank]

    def target_layout(self, rank: int | None = None) -> tuple[LocalTensor, ...]:
        """The local tensors target rank ``rank`` (default: this one) gets in the output format (:meth:`Format.output_layout`; computed once)."""
        rank = self.rank if rank is None else rank
        if rank not in self._output_layouts:  # pure and asked for by every stage
            self._output_layouts[rank] = self.output_format.output_layout(self.tree, self.world_size, rank, lambda: self.optimizer_layout(rank))
        return self._output_layouts[rank]

    def optimizer_layout(self, rank: int | None = None) -> tuple[LocalTensor, ...]:
        """The local tensors of target rank ``rank``'s optimizer, in ``model.parameters()`` order (computed once)."""
        rank = self.rank if rank is None else rank
        if rank not in self._optimizer_layouts:
            self._optimizer_layouts[rank] = rank_layout(self.tree, self.spec.target.spec(), rank)
        return self._optimizer_layouts[rank]
