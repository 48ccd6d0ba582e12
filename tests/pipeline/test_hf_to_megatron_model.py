"""Which model a checkpoint converted to Megatron is read as (:func:`osdpipe.pipeline.hf_to_megatron.source_model`):
the user's, torchtitan's names for it, a torchtitan folder's ``model_args.json``, else the folder's ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from osdpipe.pipeline.hf_to_megatron import FROM_CONFIG, source_model
from osdpipe.spec.reconcile import Given

ARGS = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 128, "vocab_size": 1000}


def _raw(layout: str, path: Path, **checkpoint) -> dict:
    return {"checkpoint": {"layout": layout, **checkpoint}, "input": {"path": str(path)},
            "model": {"factory": "nested", "kwargs": {}}}


@pytest.mark.parametrize("args, factory", [(ARGS, "torchtitan_llama3"), ({**ARGS, "head_dim": 24}, "torchtitan_qwen3")])
def test_a_torchtitan_folder_with_model_args_is_read_as_that_llama3_or_qwen3(tmp_path: Path, args: dict,
                                                                             factory: str) -> None:
    """``model_args.json`` names the factory whose keywords it holds: qwen3's has a ``head_dim``."""
    (tmp_path / "model_args.json").write_text(json.dumps(args))
    (tmp_path / "step-3").mkdir()
    given = Given(["checkpoint=torchtitan", f"input.path={tmp_path}"])  # a group override gives checkpoint.*
    for path in (tmp_path, tmp_path / "step-3"):
        model = source_model(_raw("torchtitan", path), given)
        assert (model["factory"], model["kwargs"]) == (factory, args)


def test_torchtitans_names_and_the_users_model_win(tmp_path: Path) -> None:
    (tmp_path / "model_args.json").write_text(json.dumps(ARGS))
    named = {**_raw("torchtitan", tmp_path, model="llama3", flavor="8B"),
             "model": {"factory": "torchtitan", "kwargs": {"name": "llama3", "flavor": "8B"}}}
    assert source_model(named, Given(["checkpoint=torchtitan"]))["kwargs"] == {"name": "llama3", "flavor": "8B"}
    mine = {**_raw("accelerate", tmp_path), "model": {"factory": "pkg.mod:build", "kwargs": {}}}
    assert source_model(mine, Given(["model.factory=pkg.mod:build"]))["factory"] == "pkg.mod:build"


def test_a_hugging_face_folder_is_read_as_its_config_jsons_llama(tmp_path: Path) -> None:
    model = source_model(_raw("accelerate", tmp_path), Given(["checkpoint=accelerate"]))
    assert (model["factory"], model["kwargs"]) == (FROM_CONFIG, {"path": str(tmp_path)})
