"""Layer 6, proof: the checks, their stage, and training resumed from the output.

The checks (:mod:`osdpipe.verify.checks`) look at a rank's converted state and
compare it with the source, PyTorch's own conversion, a resumed job; the
verify stage (:mod:`osdpipe.verify.stage`) runs those the spec names.
"""
