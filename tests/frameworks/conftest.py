"""Fixtures the framework tests share across modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def megatron_saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every Megatron-LM source of :data:`frameworks.mcore_saves.SAVES`, saved once per session by megatron-core.

    ``OSDPIPE_TEST_MEGATRON_SAVES`` names a folder where :func:`~frameworks.mcore_saves.make_saves` saved them before:
    a developer's loop over the Megatron tests reuses them (about 2 minutes each session); CI sets none."""
    import os

    from frameworks.mcore_saves import SAVES, make_saves

    kept = os.environ.get("OSDPIPE_TEST_MEGATRON_SAVES")
    if kept:
        return {name: Path(kept) / name for name in SAVES if (Path(kept) / name).is_dir()}
    return make_saves(tmp_path_factory.mktemp("megatron"))


#: The sources of :func:`megatron_logits`: a save of each family and feature a Hugging Face or torchtitan model is
#: proven to compute the logits of.
LOGITS_OF = ("tp2_dp2_bias", "tp2_pp2_qkv_bias", "gpt_tp2_pp2", "qwen3_tp2_pp2")


@pytest.fixture(scope="session")
def megatron_logits(megatron_saves: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The logits megatron-core computes on the probe tokens from each source of :data:`LOGITS_OF`, loaded at its own
    grid: the loads in one launch (:func:`frameworks.mcore.each`; a launch's start is most of a load's time)."""
    import torch
    from frameworks import mcore
    from frameworks.mcore_saves import SAVES, WORLD

    root = tmp_path_factory.mktemp("megatron_logits")
    jobs = []
    for name in LOGITS_OF:
        save = SAVES[name]
        jobs.append(mcore.load_argv(megatron_saves[name], root / f"{name}.pt", tp=save.tp, pp=save.pp,
                                    bias=save.bias, model=save.model, qk=save.qk, logits=root / f"{name}.logits.pt"))
    mcore.each(root, WORLD, jobs, label="load-logits", timeout=600)
    return {name: torch.load(root / f"{name}.logits.pt", weights_only=True) for name in LOGITS_OF}
