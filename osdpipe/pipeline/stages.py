"""The stage registry: each stage's name and the function that runs it on a rank, in the order they run.

A stage is a function ``(ctx, previous product, tally) -> product`` that
every rank calls (:mod:`osdpipe.run.products` lists what each makes);
``pipeline.stages`` in the config picks which run (the names are the spec's,
:data:`osdpipe.spec.config.STAGE_ORDER`). Adding a stage is its module and its
line here; the stage modules never import this package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from osdpipe.run.context import Context
from osdpipe.run.products import Tally
from osdpipe.run.stages import broadcast, flatten, load, rekey, save, shard
from osdpipe.verify import stage as verify

StageFn = Callable[[Context, Any, Tally], Any]

STAGES: dict[str, StageFn] = {
    "load": load.load,
    "broadcast": broadcast.broadcast,
    "flatten": flatten.flatten,
    "shard": shard.shard,
    "rekey": rekey.rekey,
    "verify": verify.verify,
    "save": save.save,
}
