"""What several checks share: what they look at (:class:`Subject`),
the whole source or output on every rank, the live target job, the size limit."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from osdpipe.core.sizes import show_size
from osdpipe.io.formats import Format, SourceReader, TensorRef, full_state
from osdpipe.io.formats.base import WEIGHTS, SourceMeta
from osdpipe.io.weights import model_state_dict
from osdpipe.layout import kinds
from osdpipe.layout.ranges import LocalTensor
from osdpipe.layout.tree import ModuleTree
from osdpipe.run.collective import from_rank0, gather_to_all
from osdpipe.run.context import Context
from osdpipe.run.live_jobs import live_target
from osdpipe.run.products import Described, Keyed, Tally
from osdpipe.run.stages.shard import read_source
from osdpipe.run.streamed_output import StreamedOutput
from osdpipe.run.transfer import Source
from osdpipe.run.world import World
from osdpipe.spec.config import RunSpec
from osdpipe.spec.plan import Plan

#: Where the Python API leaves a rank's live target model and optimizer in :attr:`World.kept`, keyed with the rank.
LIVE_TARGET = "live target"


@dataclass
class Subject:
    """What a check looks at on one rank: where it runs, the state it checks, and the source it came from.

    ``keyed`` is the rank's converted state (``None`` where ``osdpipe check
    --load`` checks written files instead), ``source`` the described source
    (``None`` where it could not be read). The real target job is built on
    first use and kept for the rank's other checks (or is the Python API's).
    """

    ctx: Context
    keyed: Keyed | None
    source: Described | None
    tally: Tally
    #: Per target rank, the layout keys its optimizer holds,
    #: as the ranks published them (a live optimizer's own groups).
    held: dict[int, set[str]] = field(default_factory=dict)
    _live: tuple[Any, Any] | None = field(default=None, repr=False)

    @property
    def plan(self) -> Plan:
        return self.ctx.plan

    @property
    def spec(self) -> RunSpec:
        return self.ctx.spec

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def tree(self) -> ModuleTree:
        return self.ctx.tree

    @property
    def world(self) -> World:
        return self.ctx.world

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def id_keyed(self) -> bool:
        return self.ctx.id_keyed

    @property
    def output_format(self) -> Format:
        return self.ctx.output_format

    @property
    def input_path(self) -> str:
        return self.ctx.plan.input_path

    @property
    def input_format(self) -> str:
        return self.ctx.plan.input_format

    def target_layout(self, rank: int | None = None) -> tuple[LocalTensor, ...]:
        return self.ctx.target_layout(rank)

    def optimizer_layout(self, rank: int | None = None) -> tuple[LocalTensor, ...]:
        return self.ctx.optimizer_layout(rank)

    def held_keys(self, rank: int) -> set[str]:
        """The layout keys target rank ``rank``'s optimizer holds (published by the ranks, else the plan's)."""
        if rank not in self.held:
            self.held[rank] = self.ctx.plan.held_keys(rank)
        return self.held[rank]

    @property
    def result(self) -> dict[str, Any] | None:
        """The state dict this rank's output holds."""
        return None if self.keyed is None else self.keyed.state_dict

    @property
    def result_keys(self) -> dict[str, Any]:
        return {} if self.keyed is None else self.keyed.keys

    @property
    def local_state(self) -> dict[str, dict[str, Any]]:
        """This rank's converted tensors by layout key, before rekey keyed them."""
        return {} if self.keyed is None else self.keyed.sharded.state

    @property
    def flat_state(self) -> dict[str, dict[str, Any]]:
        return {} if self.keyed is None else self.keyed.sharded.flat.entries

    @property
    def streamed(self) -> StreamedOutput | None:
        """Where this rank's output is made as save writes it,
        its placeholders and their filler (see :mod:`osdpipe.run.streamed_output`)."""
        return None if self.keyed is None else self.keyed.sharded.streamed

    @property
    def sent_digests(self) -> dict[int, dict[tuple[str, str, int], str]]:
        return {} if self.keyed is None else self.keyed.sharded.sent_digests

    @property
    def meta(self) -> SourceMeta | None:
        return None if self.source is None else self.source.meta

    @property
    def reader(self) -> SourceReader | None:
        return None if self.source is None else self.source.reader

    @property
    def reading_ranks(self) -> tuple[int, ...] | None:
        return None if self.source is None else self.source.reading_ranks

    @property
    def reads_itself(self) -> bool:
        return self.source is None or self.source.reads_itself(self.rank)

    def read_source(self) -> Source:
        """This rank's reader of the source, in pieces of the size ``runtime.memory_budget`` allows."""
        assert self.source is not None, "the broadcast stage describes the source"
        return read_source(self.ctx, self.source)

    @property
    def warnings(self) -> list[str]:
        return self.tally.warnings

    @property
    def live(self) -> tuple[Any, Any]:
        """This rank's real target model and optimizer: the Python API's own, else built once, on first use."""
        if self._live is None:
            self._live = self.world.kept.get((LIVE_TARGET, self.rank)) or live_target(
                self.spec, self.plan.target_spec, self.tree, self.rank
            )
        return self._live


def source_tensor_bytes(ctx: Subject) -> int:
    """The bytes of the source's tensor state (what a check holding the whole state holds on every rank)."""
    assert ctx.meta is not None
    return sum(
        math.prod(v.shape) * v.torch_dtype.itemsize
        for entries in ctx.meta.state.values()
        for v in entries.values()
        if isinstance(v, TensorRef)
    )


def within_full_state_limit(ctx: Subject) -> bool:
    limit = ctx.spec.pipeline.full_state_checks_max
    return limit is None or source_tensor_bytes(ctx) <= limit


def full_source(ctx: Subject) -> dict[str, Any]:
    """The whole source as a full FQN-keyed state dict (for PyTorch's reference conversion)."""
    assert ctx.meta is not None and ctx.reader is not None
    return full_state(ctx.reader, ctx.meta)


def full_output(ctx: Subject) -> dict[str, Any]:
    """The FQN-keyed output gathered to full tensors on every rank (``fsdp_full`` or ``dcp``)."""
    assert ctx.result is not None
    if ctx.output_format.one_writer:  # rank 0 holds it all
        return from_rank0("verify", lambda: ctx.result)
    pieces = gather_to_all(ctx.result["state"])
    state: dict[str, dict[str, Any]] = {}
    for fqn in pieces[0]:
        state[fqn] = {}
        for name, value in pieces[0][fqn].items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[fqn][name] = torch.cat([p[fqn][name] for p in pieces if fqn in p and p[fqn][name].numel()], dim=0)
            else:
                state[fqn][name] = value
    return {**ctx.result, "state": state}


def whole(ctx: Subject) -> bool:
    """Whether the source is a whole checkpoint,
    so the output holds the model's weights beside the optimizer's state."""
    return ctx.meta is not None and ctx.meta.carried is not None


def model_only(ctx: Subject) -> bool:
    """Whether the source is a model-only checkpoint (torchtitan's last save, its seed checkpoint):
    its output holds no optimizer to load or compare."""
    return whole(ctx) and not ctx.meta.carried.carrying.optimizer


def local_model_output(ctx: Subject) -> dict[str, Any]:
    """This rank's output ``model.state_dict()`` as local tensors: every name of a tied weight, buffers whole."""
    assert ctx.keyed is not None and ctx.keyed.weights is not None and ctx.meta is not None
    return model_state_dict(ctx.keyed.weights, ctx.meta.buffers, ctx.tree)


def full_model_output(ctx: Subject) -> dict[str, Any]:
    """The output's model weights gathered to full tensors on every rank
    (a ``dcp`` output: each rank holds its dim-0 rows)."""
    assert ctx.keyed is not None and ctx.keyed.weights is not None and ctx.meta is not None
    pieces = gather_to_all(ctx.keyed.weights)
    full = {
        fqn: torch.cat([p[fqn] for p in pieces if fqn in p and p[fqn].numel()], dim=0).reshape(
            ctx.tree.param(fqn).shape
        )
        for fqn in pieces[0]
    }
    return model_state_dict(full, ctx.meta.buffers, ctx.tree)


def full_model_source(ctx: Subject) -> dict[str, Any]:
    """The source's model weights read whole: what PyTorch's own conversion of the model starts from."""
    assert ctx.meta is not None and ctx.reader is not None
    fqns = [f for f, entries in ctx.meta.state.items() if WEIGHTS in entries]
    read = ctx.reader.read([(f, WEIGHTS) for f in fqns])
    return model_state_dict({f: read[(f, WEIGHTS)] for f in fqns}, ctx.meta.buffers, ctx.tree)


def live_target_of(ctx: Subject) -> tuple[Any, Any]:
    """This rank's live target model and optimizer, built once per rank."""
    return ctx.live


def loadable(ctx: Subject) -> dict[str, Any]:
    """What this rank's target optimizer loads from the output."""
    assert ctx.result is not None
    if ctx.id_keyed:
        return ctx.result
    model, optim = live_target_of(ctx)
    return kinds.get(ctx.spec.target.kind).to_load(model, optim, full_output(ctx))


def with_groups(loadable: dict[str, Any], optim: Any) -> dict[str, Any]:
    """A source without param groups converts to state only (as PyTorch's own conversion does); load_state_dict needs
    groups, so the target's own are what a resuming job pairs it with."""
    if "param_groups" not in loadable:
        loadable["param_groups"] = optim.state_dict()["param_groups"]
    return loadable


def needs_target_world(ctx: Subject) -> str | None:
    """Why a check that loads into a live target job with the whole source
    (``reference``, ``load_step``) cannot run here, or ``None``."""
    if (why := kinds.get(ctx.spec.target.kind).no_live_job) is not None:
        return f"needs a live {ctx.spec.target.kind} job, which osdpipe does not build ({why})"
    if not ctx.world.builds_target:
        return "needs a live target world (runtime.mode=online)"
    if ctx.spec.runtime.transfer == "scatter":
        return "needs the whole source on every rank, which runtime.transfer=scatter does not read everywhere"
    limit, size = ctx.spec.pipeline.full_state_checks_max, source_tensor_bytes(ctx)
    if limit is not None and size > limit:
        return (
            "needs the whole state on every rank or a live target model, "
            f"and the source holds {show_size(size)} of tensor state, "
            f"over pipeline.full_state_checks_max={show_size(limit)}: raise it (or set it to null) to run it"
        )
    return None

