"""The proof of a conversion into a Megatron-LM save (its verify stage, and ``osdpipe check``): the written save
read back a tensor at a time and held against the source's save, then what else the source asks (a Hugging Face
source's own tensors, mapped back) asked of that save. What it proves: one wrong element of the written files is
named, beside what the source's own question found; the source's question gets the save itself, and no read-back is
kept whole."""

from __future__ import annotations

from pathlib import Path

import torch
from synthetic_megatron import one_element_changed, synthetic_save

from osdpipe.io.formats import megatron as megatron_format
from osdpipe.io.formats.megatron import MegatronSave, read_save
from osdpipe.io.formats.megatron_writer import Target, write_save
from osdpipe.verify import megatron as verify_megatron
from osdpipe.verify.megatron import written_problems

TARGET = Target(1, 1, 2, "dp_reshardable")


def _first_bucket(key: str) -> bool:
    return "bucket_idx_" in key and key.endswith(".exp_avg")


def test_one_wrong_written_element_is_named_beside_what_the_source_asks(tmp_path: Path) -> None:
    save = read_save(synthetic_save(tmp_path, tp=2))
    write_save(save, tmp_path / "right", TARGET)
    with one_element_changed(_first_bucket, 3) as changed:
        write_save(save, tmp_path / "wrong", TARGET)
    assert changed

    def also(held: MegatronSave) -> list[str]:
        return ["the source's own question"]

    assert written_problems(save, tmp_path / "right") == []
    assert written_problems(save, tmp_path / "right", also) == ["the source's own question"]
    problems = written_problems(save, tmp_path / "wrong", also)
    assert len(problems) == 2 and "exp_avg" in problems[0] and "differ" in problems[0], problems
    assert problems[1] == "the source's own question"


def test_the_source_asks_its_own_save_and_nothing_is_read_back_whole(tmp_path: Path, monkeypatch) -> None:
    save = read_save(synthetic_save(tmp_path, tp=2))
    write_save(save, tmp_path / "out", TARGET)
    placements, real = [], megatron_format.read_save

    def recorded(path, **kwargs):
        placements.append(kwargs.get("placed"))
        return real(path, **kwargs)

    monkeypatch.setattr(verify_megatron, "read_save", recorded)
    asked: list[MegatronSave] = []

    def also(held: MegatronSave) -> list[str]:
        asked.append(held)
        return []

    assert written_problems(save, tmp_path / "out", also) == []
    assert [id(held) for held in asked] == [id(save)]  # the source's save itself, not a copy read back
    assert len(placements) == 1 and isinstance(placements[0], verify_megatron.Compared)
    assert any(isinstance(t, torch.Tensor) for t in save.model.values())  # the source's save is left as it was
