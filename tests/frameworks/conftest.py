"""Fixtures the framework tests share across modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def megatron_saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every Megatron-LM source of :data:`frameworks.mcore_saves.SAVES`, saved once per session by megatron-core."""
    from frameworks.mcore_saves import make_saves

    return make_saves(tmp_path_factory.mktemp("megatron"))
