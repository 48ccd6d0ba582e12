"""osdpipe.core.state_paths names every leaf of a nested state as dcp.save does, and puts it back where it was."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from osdpipe.core.state_paths import leaf_paths, put_at


def _nested() -> dict:
    """Every kind of container a framework's carried state holds."""
    return {
        "lr_scheduler": {"base_lrs": [0.1, 0.2], "last_epoch": 3, "_get_lr_called_within_step": False},
        "train_state": {"step": torch.tensor(7), "losses": [torch.ones(2), torch.zeros(3)]},
        "rng": [{"cpu": torch.arange(4, dtype=torch.uint8)}, {"cpu": torch.arange(2, dtype=torch.uint8)}],
        "betas": (0.9, 0.95),
        "deep": {"a": {"b": {1: torch.full((2,), 5.0)}}},
        "empty": [],
        "mixed": [1, {"x": 2}],
    }


def test_every_leaf_is_named_as_dcp_save_names_it(tmp_path: Path) -> None:
    state = _nested()
    dcp.save(copy.deepcopy(state), checkpoint_id=str(tmp_path / "ck"))
    saved = set(dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata)
    flat, paths = leaf_paths(state)
    assert set(flat) == saved
    assert paths["train_state.losses.1"] == ("train_state", "losses", 1)
    assert paths["deep.a.b.1"] == ("deep", "a", "b", "1")  # a mapping's key as its string
    assert flat["lr_scheduler.base_lrs"] == [0.1, 0.2]  # a list of numbers is one leaf
    assert flat["betas"] == (0.9, 0.95)


def test_the_leaves_put_back_at_their_paths_make_the_nest_again() -> None:
    state = _nested()
    flat, paths = leaf_paths(state)
    rebuilt: dict = {}
    for name in reversed(list(flat)):  # any order: the containers are made on the way
        put_at(rebuilt, paths[name], flat[name])
    assert rebuilt["rng"][0]["cpu"] is state["rng"][0]["cpu"] and rebuilt["rng"][1]["cpu"] is state["rng"][1]["cpu"]
    assert rebuilt["train_state"]["losses"][1] is state["train_state"]["losses"][1]
    assert rebuilt["deep"]["a"]["b"]["1"] is state["deep"]["a"]["b"][1]
    assert rebuilt["mixed"] == [1, {"x": 2}] and rebuilt["lr_scheduler"] == state["lr_scheduler"]


def test_two_leaves_of_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match="'a.b'"):
        leaf_paths({"a.b": 1, "a": {"b": 2}})
