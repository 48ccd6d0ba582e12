"""Where a stage runs: the plan, the world, and which of the world's ranks this is. Immutable.

What a stage makes is its product (:mod:`osdpipe.run.products`), not a field of
the context: the context only says where, and answers the plan's questions
for this rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from osdpipe.io.formats import Format
from osdpipe.layout.ranges import LocalTensor
from osdpipe.layout.tree import ModuleTree
from osdpipe.run.world import World
from osdpipe.spec.config import RunSpec
from osdpipe.spec.plan import Plan


@dataclass(frozen=True)
class Context:
    """One target rank of ``world``, running ``plan``."""

    plan: Plan
    world: World
    rank: int

    @property
    def spec(self) -> RunSpec:
        return self.plan.spec

    @property
    def tree(self) -> ModuleTree:
        return self.plan.tree

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def output_format(self) -> Format:
        return self.plan.output_format

    @property
    def id_keyed(self) -> bool:
        """Whether the output is keyed by the target optimizer's param IDs (else by FQN)."""
        return self.plan.id_keyed

    def target_layout(self, rank: int | None = None) -> tuple[LocalTensor, ...]:
        """The local tensors target rank ``rank`` (default: this one) gets in the output format."""
        return self.plan.target_layout(self.rank if rank is None else rank)

    def optimizer_layout(self, rank: int | None = None) -> tuple[LocalTensor, ...]:
        """The local tensors of target rank ``rank``'s (default: this one's) optimizer,
        in ``model.parameters()`` order."""
        return self.plan.optimizer_layout(self.rank if rank is None else rank)
