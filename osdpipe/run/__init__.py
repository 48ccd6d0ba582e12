"""Layer 5, what runs a conversion: worlds, launching, collectives, the stages and their products.

Every stage but verify is here (:mod:`osdpipe.run.stages`), with what they
share: the context, transfers between ranks, streamed output, progress,
the report, and the live PyTorch jobs a source is generated with. The stage
registry and the loop that runs them sit above verify, in :mod:`osdpipe.pipeline`.
"""
