"""Layer 7, the pipeline: the stage registry, the one loop that runs it on every rank, and a run from start to end.

It names the stages of :mod:`osdpipe.run.stages` and :mod:`osdpipe.verify.stage`
in the spec's order, so it sits above both.
"""
