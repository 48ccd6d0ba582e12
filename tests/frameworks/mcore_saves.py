"""The Megatron-LM saves the framework tests share: each trained and saved once per session by real megatron-core 0.16.1
(:mod:`frameworks.mcore`), beside the state gathered from the live job (``mcore.truth_path``), which the tests hold
osdpipe's outputs against."""

from __future__ import annotations

from pathlib import Path

import pytest
from frameworks import mcore

#: name -> (TP, PP, DP, sharding type, bf16): each saved once by real megatron-core on 4 ranks (the first three go on
#: 2 more synthetic steps after the save: what a converted output's resume must equal).
SAVES = {
    "tp2_dp2": (2, 1, 2, "dp_reshardable", False),
    "tp1_pp2_dp2": (1, 2, 2, "dp_reshardable", False),
    "tp2_pp2": (2, 2, 1, "dp_reshardable", False),
    "tp2_dp2_fully": (2, 1, 2, "fully_reshardable", False),
    "tp1_pp2_dp2_fully": (1, 2, 2, "fully_reshardable", False),
    "tp2_pp2_fully": (2, 2, 1, "fully_reshardable", False),
    "tp4_bf16": (4, 1, 1, "dp_reshardable", True),
    "tp2_dp2_fs": (2, 1, 2, "fully_sharded_model_space", False),
    "tp1_pp2_dp2_fs": (1, 2, 2, "fully_sharded_model_space", False),
}
#: The sources converted (the issue's three parallelisms, each in both sharding types Megatron-LM writes, and a bf16
#: job's; the legacy type at two), and the targets each is written for, (TP, PP, DP), in the type
#: ``output.megatron_optim_format`` unset gives (``DEFAULT_OUTPUT``).
CONVERTED = ("tp2_dp2", "tp1_pp2_dp2", "tp2_pp2", "tp2_dp2_fully", "tp1_pp2_dp2_fully", "tp2_pp2_fully", "tp4_bf16",
             "tp2_dp2_fs", "tp1_pp2_dp2_fs")


def make_saves(root: Path) -> dict[str, Path]:
    """Every source of :data:`SAVES` saved under ``root`` by real megatron-core (about 2 minutes on 2 cores): the
    session fixture ``megatron_saves`` (tests/frameworks/conftest.py) makes them once for every test module."""
    out = {}
    legacy = mcore.legacy_megatron(root) if any(s[3] == "fully_sharded_model_space" for s in SAVES.values()) else None
    for name, (tp, pp, dp, sharding, bf16) in SAVES.items():
        resumed = {"resume_truth": 2, "dump_after": resumed_path(root / name)} if name in CONVERTED else {}
        if sharding == "fully_sharded_model_space":
            if legacy is None:
                continue  # its tests skip, naming what is missing
            resumed["megatron_from"] = legacy
        out[name] = mcore.save(root, root / name, tp=tp, pp=pp, dp=dp, sharding=sharding, bf16=bf16, timeout=400,
                               **resumed)
    return out


def saved(saves: dict[str, Path], name: str) -> Path:
    """Source ``name``'s folder; a skip where it could not be saved (a legacy one without megatron-core 0.13)."""
    if name not in saves:
        pytest.skip(f"{mcore.LEGACY} could not be installed apart, so no {SAVES[name][3]} source")
    return saves[name]


def resumed_path(folder: Path) -> Path:
    return folder.with_name(folder.name + ".resumed.pt")
