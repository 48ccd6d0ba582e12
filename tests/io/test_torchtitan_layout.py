"""torchtitan's folders as torchtitan itself treats them: the newest step, model-only saves, the step an output is
written at, and what it will do with its data loader's entries on another data-parallel degree (issue 30). Real
torchtitan runs in tests/frameworks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from osdpipe.io.checkpoints import get, recognize

TITAN = get("torchtitan")


def _save(path: Path, state: dict) -> Path:
    dcp.save(state, checkpoint_id=str(path))
    return path


def _full(dp: int, step: int) -> dict:
    return {
        "w": torch.ones(4, 2),
        "optimizer": {"state.w.exp_avg": torch.zeros(4, 2), "param_groups.w.lr": 0.0},
        "dataloader": {**{f"dp_rank_{r}": b"position" for r in range(dp)}, "world_size": dp},
        "train_state": {"step": torch.tensor(step)},
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """torchtitan's --checkpoint.folder: two steps, a newer one cut short before its .metadata, and a model-only one."""
    root = tmp_path_factory.mktemp("checkpoints")
    _save(root / "step-10", _full(2, 10))
    _save(root / "step-2", _full(2, 2))
    (root / "step-30").mkdir()  # a save that died before its .metadata: torchtitan skips it, and so does osdpipe
    _save(root.parent / "model-only" / "step-20", {"w": torch.ones(4, 2)})
    _save(root.parent / "renamed", _full(4, 7))
    return root


def test_the_checkpoint_folder_is_read_as_its_newest_complete_step(folder) -> None:
    assert TITAN.newest_in(str(folder)) == str(folder / "step-10")
    assert TITAN.newest_in(str(folder / "step-2")) is None  # one step folder is itself
    assert recognize(folder).path == str(folder / "step-10")


def test_a_model_only_step_is_torchtitans_and_says_so(folder) -> None:
    whole = recognize(folder.parent / "model-only")
    assert whole.layout == "torchtitan" and whole.optimizer_path is None
    assert any("model only" in note for note in whole.notes)
    assert TITAN.optimizer_part(whole.path, "dcp") is None
    # torchtitan's own entries tell, whatever the name
    assert recognize(folder.parent / "renamed").layout == "torchtitan"


@pytest.mark.parametrize(
    ("target_dp", "said"),
    [
        (2, None),
        (4, "Missing key in checkpoint state_dict: dataloader.dp_rank_2"),
        (1, "dp_degree is inconsistent"),
    ],
)
def test_another_data_parallel_degree_is_told_what_torchtitan_does_with_its_data_loader(
    folder, target_dp, said
) -> None:
    advice = TITAN.advice(str(folder / "step-10"), {"world_size": target_dp * 2, "tp_size": 2}, "dcp")
    if said is None:
        assert advice == []
    else:
        (line,) = advice
        assert (
            said in line
            and "--checkpoint.exclude-from-loading dataloader" in line
            and f"the target has {target_dp}" in line
        )


def test_the_output_step_is_the_folders_name_else_its_train_state(folder) -> None:
    from osdpipe.io.formats.dcp_reader import DcpCheckpoint

    assert TITAN.step_of(DcpCheckpoint(str(folder / "step-2"), None), str(folder / "step-2")) == 2
    renamed = folder.parent / "renamed"
    assert TITAN.step_of(DcpCheckpoint(str(renamed), None), str(renamed)) == 7
