"""The package's version: one place, read by the command, the manifest and the build."""

__version__ = "0.1.0"
