"""The stage registry. A stage is a function ``(ctx) -> None`` that every rank calls.

Stages register themselves by name with :func:`stage`; ``pipeline.stages`` in
the config picks which run and in which order. Importing this package imports
every stage module, so the registry is complete once ``osdpipe.stages`` is.
"""

from __future__ import annotations

from collections.abc import Callable

from osdpipe.context import Context

StageFn = Callable[[Context], None]
STAGES: dict[str, StageFn] = {}


def stage(name: str) -> Callable[[StageFn], StageFn]:
    """Register ``fn`` as the stage called ``name``."""

    def register(fn: StageFn) -> StageFn:
        if name in STAGES:
            raise ValueError(f"stage {name!r} is registered twice")
        STAGES[name] = fn
        return fn

    return register


from osdpipe.stages import broadcast, flatten, load, rekey, save, shard, verify  # noqa: E402,F401  (registers)
