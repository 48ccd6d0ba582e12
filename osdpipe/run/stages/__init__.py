"""The stages a rank runs before and after verify: load, broadcast, flatten, shard, rekey, save.

Each is a function ``(ctx, previous product, tally) -> product``; the stage
registry (:mod:`osdpipe.pipeline.stages`) names them. A stage module never
imports the registry.
"""
