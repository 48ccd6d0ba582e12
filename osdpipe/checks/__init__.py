"""The verify checks: one registry, the only list of them.

Each check is a module of this package with ``run(ctx) -> CheckResult`` and
``skip_reason(ctx) -> str | None`` (why it does not run on this conversion,
in words that follow its name); ``ctx`` is what the check looks at, the
rank's :class:`~osdpipe.checks.common.Subject`. The registry itself imports no torch: the
config's choices (``pipeline.checks``), ``--help`` and ``report.json`` read
the names and descriptions here, and a check's module is imported only when
verify runs it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Literal

from osdpipe.registry import member

if TYPE_CHECKING:
    from osdpipe.checks.common import Subject
    from osdpipe.products import CheckResult

#: What running a check holds and does, for a user choosing which to run on a large conversion.
Cost = Literal["streams", "whole state", "steps", "digests"]


@dataclass(frozen=True)
class Check:
    """One check: its name, what it proves, what it costs, and whether skipping it is news."""

    name: str
    proves: str
    #: ``streams``: reads in pieces, bounded by ``runtime.memory_budget``; ``whole state``: the whole source on every
    #: rank and a live target job (``pipeline.full_state_checks_max``); ``steps``: optimizer steps over this rank's
    #: state; ``digests``: compares hashes, a few per tensor.
    cost: Cost
    #: A skipped check is said in the report's warnings, unless it merely does not apply (``replicas`` without replicas).
    warn_when_skipped: bool = True
    #: The module with its ``run`` and ``skip_reason`` (default: ``osdpipe.checks.<name>``).
    where: str | None = None
    #: Whether it runs unless ``pipeline.checks`` says otherwise; one that runs a framework's own code on the input is asked for.
    by_default: bool = True

    @property
    def module(self) -> ModuleType:
        # Imported on first use: the checks import torch, which config validation and --help must not.
        return importlib.import_module(self.where or f"{__name__}.{self.name}")

    def skip_reason(self, ctx: Subject) -> str | None:
        return self.module.skip_reason(ctx)

    def run(self, ctx: Subject) -> CheckResult:
        return self.module.run(ctx)


CHECKS: tuple[Check, ...] = (
    Check("roundtrip", "every converted element equals the source's, bitwise; padding is zero; the ranks cover every source element", "streams"),
    Check("reference", "PyTorch's own conversion on the target world gives the same bytes, keys and param groups", "whole state"),
    Check("load_step", "the target optimizer loads the result and one step keeps finite what was finite", "whole state"),
    Check("resume", "no two state tensors share memory; a job resuming from the output steps as one resuming from the source", "steps"),
    Check("replicas", "hybrid sharding: every replica group holds the same state, in the source and in the output", "digests", warn_when_skipped=False),
    Check("universal", "a DeepSpeed source: DeepSpeed's own ds_to_universal holds the weights, moments and steps read, bitwise "
          "(asked for: it runs DeepSpeed's loading, which unpickles the save with its code)", "whole state", by_default=False),
)



def names() -> tuple[str, ...]:
    """The check names, in the order verify runs them (the config's ``pipeline.checks`` choices)."""
    return tuple(c.name for c in CHECKS)


def default_names() -> tuple[str, ...]:
    """The checks that run unless ``pipeline.checks`` says otherwise (the config's default)."""
    return tuple(c.name for c in CHECKS if c.by_default)


def get(name: str) -> Check:
    """The check called ``name``.

    Raises:
        ValueError: naming the checks there are.
    """
    return member({c.name: c for c in CHECKS}, name, "check")
