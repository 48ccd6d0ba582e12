"""What runs each check of the catalog (:mod:`osdpipe.spec.checks`): a module of this package per check.

Each module has ``run(ctx) -> CheckResult`` and ``skip_reason(ctx) -> str |
None`` (why it does not run on this conversion, in words that follow its
name); ``ctx`` is what the check looks at, the rank's
:class:`~osdpipe.verify.checks.common.Subject`. Adding a check is its line in
the catalog, its module here and its line in :data:`RUNS`; the structure test
holds the two lists equal.
"""

from __future__ import annotations

from types import ModuleType

from osdpipe.core.registry import member
from osdpipe.verify.checks import load_step, reference, replicas, resume, roundtrip, universal

#: Check name -> the module that runs it, in the catalog's order.
RUNS: dict[str, ModuleType] = {
    "roundtrip": roundtrip,
    "reference": reference,
    "load_step": load_step,
    "resume": resume,
    "replicas": replicas,
    "universal": universal,
}


def runner(name: str) -> ModuleType:
    """The module that runs the check ``name``.

    Raises:
        ValueError: naming the checks there are.
    """
    return member(RUNS, name, "check")
