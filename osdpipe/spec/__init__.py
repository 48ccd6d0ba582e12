"""Layer 4, the run spec: the validated config, settled against what the files show, and the plan made of it.

The pydantic schema is validated against the registries of formats and
checkpoint layouts (:mod:`osdpipe.io`), so it sits above them; the check
catalog the config names lives here, its checks in :mod:`osdpipe.verify`.
"""
