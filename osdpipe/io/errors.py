"""The error a bad input is said with, in a module of its own that imports nothing: the store's client
(:mod:`osdpipe.io.store`) and the loaders (:mod:`osdpipe.io.formats.safe_load`) raise it without importing the formats'
base, which itself reads files through them (a file osdpipe wrote, from object storage:
:func:`osdpipe.io.formats.base.load_written`). :mod:`osdpipe.io.formats.base` names it too, where most code imports it.
"""

from __future__ import annotations


class InputError(ValueError):
    """A damaged or wrong input. Its message is one line: the file, what is wrong, and what to do."""

    def __init__(self, message: str) -> None:
        # Callers build one line; text quoted from elsewhere (an exception, a name) must not break it.
        super().__init__(" ".join(line.strip() for line in str(message).splitlines() if line.strip()))


class ModelRefused(InputError):
    """The checkpoint's files were read, and the model they describe cannot be built for the output asked for (a
    feature its family cannot express, an arg it needs missing). Said when the config is worked out, before anything
    runs: unlike an input that cannot be read, no later check would say it (the run would build another model)."""
