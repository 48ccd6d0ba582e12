"""The config as the command composes it, without the command: for the tests of the spec and of start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module

from osdpipe.cli.compose import job_config


def compose_raw(overrides: list[str] = (), *, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Compose ``config`` as the CLI does and resolve it to the plain dict the CLI hands to validate.

    ``output_dir`` plays the run directory Hydra would create, the default of
    ``output.path`` (:func:`osdpipe.cli.compose.job_config`, as in the CLI).
    """
    with initialize_config_module(version_base="1.3", config_module="osdpipe.conf"):
        cfg = compose("config", overrides=list(overrides))
    return job_config(cfg, str(output_dir) if output_dir is not None else "/nonexistent/osdpipe-test-run-dir")
