"""Digests taken while writing (``osdpipe.digest``) equal those of the bytes on disk, and save's structure check can fail."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from osdpipe import digest
from osdpipe.formats.base import write_torch_file


def _state() -> dict:
    torch.manual_seed(0)
    wide = torch.randn(6, 10)
    return {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 4), "exp_avg_sq": wide[:, ::2]},  # a strided view
            1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(7).to(torch.bfloat16), "exp_avg_sq": torch.empty(0)},
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
    }


def test_save_hashed_digests_are_those_of_the_file_and_the_tensors(tmp_path: Path) -> None:
    osd, path = _state(), tmp_path / "rank_0.pt"
    file_digest, per_tensor = digest.save_hashed(osd, path)
    assert file_digest == hashlib.sha256(path.read_bytes()).hexdigest()
    expected = {
        f"{pid}.{name}": hashlib.sha256(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for pid, entries in osd["state"].items()
        for name, value in entries.items()
    }
    assert per_tensor == expected
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["state"][0]["exp_avg_sq"], osd["state"][0]["exp_avg_sq"])


def test_a_file_whose_structure_differs_from_the_state_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the structure check is for: a writer that drops or reshapes something must not pass."""
    real_save = digest.save_torch_file

    def lossy_save(obj, path, **kwargs):
        return real_save({**obj, "state": {**obj["state"], 1: {**obj["state"][1], "exp_avg": torch.zeros(6, dtype=torch.bfloat16)}}}, path, **kwargs)

    monkeypatch.setattr(digest, "save_torch_file", lossy_save)
    with pytest.raises(OSError, match=r"rank_0\.pt does not read back as written: .*\[1\]\['exp_avg'\]: tensor\(6,\) bfloat16 vs tensor\(7,\) bfloat16"):
        write_torch_file(_state(), tmp_path / "rank_0.pt")
