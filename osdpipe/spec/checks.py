"""The verify checks the config can name: one catalog, the only list of them.

Each line says what a check proves and costs. The config's choices
(``pipeline.checks``), ``--help`` and ``report.json`` read it here, in the
spec layer, without importing torch. What runs a check is in the verify layer:
the module of the same name in :mod:`osdpipe.verify.checks`, whose table the
structure test holds equal to this catalog.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from osdpipe.core.registry import member

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
    #: A skipped check is said in the report's warnings,
    #: unless it merely does not apply (``replicas`` without replicas).
    warn_when_skipped: bool = True
    #: Whether it runs unless ``pipeline.checks`` says otherwise;
    #: one that runs a framework's own code on the input is asked for.
    by_default: bool = True


CHECKS: tuple[Check, ...] = (
    Check(
        "roundtrip",
        "every converted element equals the source's, bitwise; padding is zero; the ranks cover every source element",
        "streams",
    ),
    Check(
        "reference",
        "PyTorch's own conversion on the target world gives the same bytes, keys and param groups",
        "whole state",
    ),
    Check(
        "load_step",
        "the target optimizer loads the result and one step keeps finite what was finite",
        "whole state",
    ),
    Check(
        "resume",
        "no two state tensors share memory; a job resuming from the output steps as one resuming from the source",
        "steps",
    ),
    Check(
        "replicas",
        "hybrid sharding: every replica group holds the same state, in the source and in the output",
        "digests",
        warn_when_skipped=False,
    ),
    Check(
        "universal",
        "a DeepSpeed source: DeepSpeed's own ds_to_universal holds the weights, moments and steps read, bitwise "
        "(asked for: it runs DeepSpeed's loading, which unpickles the save with its code)",
        "whole state",
        by_default=False,
    ),
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
