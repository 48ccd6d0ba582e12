"""The plan: everything a run does, decided once in the launcher before any rank starts.

The spec (:class:`~osdpipe.spec.config.RunSpec`) says what the user asked for and
is checked without torch. The plan adds what only the model can answer: the
module tree of a ``meta`` model (built once per run, here), whether both
wrappings fit it, where the input is and in which format, and from those the
layout of every target rank. It is immutable and picklable: the launcher
sends it to every rank, which never sees Hydra objects and never builds the
model's tree again.

Layouts are pure functions of the plan, computed on first use and the last
few kept; what is kept is not pickled (a rank computes its own).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdpipe.io import checkpoints, formats
from osdpipe.io.checkpoints import CheckpointLayout
from osdpipe.io.formats import Format
from osdpipe.io.output import GENERATED_SOURCE, STAGING
from osdpipe.layout import kinds
from osdpipe.layout.kinds import rank_layout
from osdpipe.layout.models import meta_model
from osdpipe.layout.optim import group_members
from osdpipe.layout.ranges import LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree, describe
from osdpipe.spec.config import ConfigError, RunSpec

if TYPE_CHECKING:
    from osdpipe.io.remote_output import Upload

#: How many layouts a plan keeps:
#: a rank's output and optimizer layouts, and a few of the ranks a stage asks about besides.
KEPT_LAYOUTS = 8


@dataclass(frozen=True)
class Plan:
    """What one conversion does: the spec, the model's tree, the input, and (derived) every rank's layout."""

    spec: RunSpec
    tree: ModuleTree
    #: The source checkpoint: ``input.path``, or where the source world saves the one it generates.
    input_path: str
    #: The format it is read in (given, or what the source world saves).
    input_format: str
    #: How the source job and the target job are wrapped,
    #: with what only the model and PyTorch could add (:meth:`LayoutKind.settle`).
    source_spec: LayoutSpec
    target_spec: LayoutSpec
    #: The live target optimizer's param groups as indices into its layout, when the Python API is handed one;
    #: otherwise they follow ``optim.param_groups``.
    optim_groups: tuple[tuple[int, ...], ...] | None = None
    #: Where the files go when ``output.path`` is in object storage (the spec's is then the job's local directory):
    #: each rank's are sent there as soon as they are written (:mod:`osdpipe.io.upload_queue`).
    upload: Upload | None = None
    _kept: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        # layouts are recomputed where they are needed: 1024 of them would travel to every rank
        return {**self.__dict__, "_kept": {}}

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(self.spec.pipeline.stages)

    @property
    def world_size(self) -> int:
        """The target world's size."""
        return self.spec.target.world_size

    @property
    def output_format(self) -> Format:
        return formats.get(self.spec.output.format)

    @property
    def checkpoint(self) -> CheckpointLayout:
        """How the input is laid out: the optimizer alone, or a whole training checkpoint (``checkpoint=``)."""
        return checkpoints.get(self.spec.checkpoint.layout)

    @property
    def output_checkpoint(self) -> CheckpointLayout:
        """How the output is laid out: ``output.checkpoint``,
        else as the input (see :func:`osdpipe.io.checkpoints.written`)."""
        return checkpoints.written(self.spec.checkpoint.layout, self.spec.output.checkpoint)

    @property
    def id_keyed(self) -> bool:
        """Whether the output is keyed by the target optimizer's param IDs (else by FQN)."""
        return self.output_format.keyed_by_id

    def optimizer_layout(self, rank: int) -> tuple[LocalTensor, ...]:
        """The local tensors of target rank ``rank``'s optimizer, in ``model.parameters()`` order."""
        return self._keep(("optimizer", rank), lambda: rank_layout(self.tree, self.target_spec, rank))

    def target_layout(self, rank: int) -> tuple[LocalTensor, ...]:
        """The local tensors target rank ``rank`` gets in the output format (:meth:`Format.output_layout`)."""
        return self._keep(
            ("output", rank),
            lambda: self.output_format.output_layout(
                self.tree, self.target_spec, rank, lambda: self.optimizer_layout(rank)
            ),
        )

    def target_groups(self, layout: tuple[LocalTensor, ...]) -> list[list[int]]:
        """A target rank's optimizer's param groups as indices into ``layout``:
        the live optimizer's, else ``optim.param_groups``."""
        if self.optim_groups is not None:
            return [list(g) for g in self.optim_groups]
        return group_members(self.spec.optim, layout)

    def held_keys(self, rank: int) -> set[str]:
        """The layout keys of target rank ``rank``'s output that its optimizer holds: those of a parameter its param
        groups hold (asked of the optimizer's own layout, whose tensors each lie in one group: an output's may not, as
        a distributed optimizer's bucket holds parameters of both)."""
        optimizer = self.optimizer_layout(rank)
        held = {f for g in self.target_groups(optimizer) for i in g for f in optimizer[i].fqns}
        return {t.key for t in self.target_layout(rank) if any(f in held for f in t.fqns)}

    def with_optimizer_groups(self, groups: list[list[int]]) -> Plan:
        """This plan, keyed by a live optimizer's own param groups (the Python API)."""
        return dataclasses.replace(self, optim_groups=tuple(tuple(g) for g in groups), _kept={})

    def _keep(self, key: Any, make: Any) -> Any:
        """``make()``, kept while it is among the last :data:`KEPT_LAYOUTS` asked for: every stage asks for its rank's
        layouts, and a solo world playing 1024 ranks must not hold every rank's at once."""
        if key in self._kept:
            self._kept[key] = self._kept.pop(key)  # the most recently asked for goes last
        else:
            self._kept[key] = make()
            while len(self._kept) > KEPT_LAYOUTS:
                del self._kept[next(iter(self._kept))]
        return self._kept[key]


def _keyed(exc: ValueError, side: str, key: str, value: object) -> str:
    """A layout's refusal as the line that names its key: its own words where they begin with the key they are about
    (``target.tp_size=3 does not divide ...``), else prefixed with ``<side>.<key>=<value>``."""
    said = str(exc)
    return said if said.startswith(f"{side}.") else f"{side}.{key}={value}: {said}"


def plan_run(spec: RunSpec, tree: ModuleTree | None = None) -> Plan:
    """The plan of ``spec``: its model's tree built on ``meta`` (unless given),
    both wrappings settled and checked against it.

    Settling asks PyTorch what only it can say: with tensor parallelism, each
    parameter's placements (a probe process, about as long as importing torch).

    Raises:
        ConfigError: naming the key whose value the model does not fit (``model``, ``source.wrap``, ``target.wrap``).
    """
    if tree is None:
        tree = model_tree(spec)
    settled = {}
    for side in ("source", "target"):
        layout = getattr(spec, side)
        kind = kinds.get(layout.kind)
        wrapped = layout.spec()
        if side == "target":  # how its distributed optimizer saves its state, where the kind has more than one way
            wrapped = dataclasses.replace(wrapped, state_sharding=spec.output.megatron_optim_format)
        try:
            settled[side] = kind.settle(wrapped, spec.model.factory, spec.model.kwargs)
        except ValueError as exc:
            raise ConfigError([_keyed(exc, side, "tp_plan", layout.tp_plan)]) from None
        try:
            kind.check(tree, settled[side])
        except ValueError as exc:
            raise ConfigError([_keyed(exc, side, "wrap", layout.wrap)]) from None
    if tree.key_maps and checkpoints.get(spec.checkpoint.layout).whole and formats.get(spec.output.format).keyed_by_id:
        raise ConfigError([
            f"output.format={spec.output.format}: the model's state dict holds keys its hooks make of parameters' rows "
            f"({tree.key_maps[0].name}, ...), "
            "which a rank's own file cannot hold as its live model's state_dict() makes them; set output.format=dcp"
        ])
    if formats.get(spec.output.format).loaded_by_dcp:
        why = kinds.get(spec.target.kind).dcp_load_problem(tree, settled["target"])
        if why is not None:
            raise ConfigError([f"output.format={spec.output.format}: {why}"])
    return Plan(
        spec,
        tree,
        spec.input.path or generated_source_path(spec),
        spec.source_input_format,
        settled["source"],
        settled["target"],
    )


def model_tree(spec: RunSpec) -> ModuleTree:
    """The module tree of ``spec``'s model, built on the ``meta`` device (no memory, no process group).

    Raises:
        ConfigError: when ``model.factory`` cannot build it.
    """
    try:
        return describe(meta_model(spec.model.factory, spec.model.kwargs))
    except (ValueError, TypeError) as exc:
        raise ConfigError([f"model: {exc}"]) from None


def generated_source_path(spec: RunSpec) -> str:
    """Where the source world saves the checkpoint it generates:
    ``source/`` of the staged run (:mod:`osdpipe.io.output`).

    It is committed with the conversion, as ``<output.path>/source/``, and
    replaced with it.
    """
    layout = checkpoints.get(spec.checkpoint.layout)
    name = (
        layout.generated_name(spec.generate.steps)
        if layout.whole
        else formats.get(spec.source_input_format).generated_name
    )
    return str(Path(spec.output.path) / STAGING / GENERATED_SOURCE / name)
