"""Digests taken while writing (``osdpipe.io.digest``) equal those of the bytes on disk,
and save's structure check can fail."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from helpers import digest_by_hand

from osdpipe.io import digest
from osdpipe.io.formats.base import write_torch_file


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
    assert file_digest == digest_by_hand(path, list(file_digest.pieces))
    expected = {
        f"{pid}.{name}": hashlib.sha256(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for pid, entries in osd["state"].items()
        for name, value in entries.items()
    }
    assert per_tensor == expected
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["state"][0]["exp_avg_sq"], osd["state"][0]["exp_avg_sq"])


def test_a_file_whose_structure_differs_from_the_state_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the structure check is for: a writer that drops or reshapes something must not pass."""
    real_save = digest.save_torch_file

    def lossy_save(obj, path, **kwargs):
        wrong = {**obj["state"][1], "exp_avg": torch.zeros(6, dtype=torch.bfloat16)}
        return real_save({**obj, "state": {**obj["state"], 1: wrong}}, path, **kwargs)

    monkeypatch.setattr(digest, "save_torch_file", lossy_save)
    with pytest.raises(
        OSError,
        match=r"rank_0\.pt does not read back as written: "
        r".*\[1\]\['exp_avg'\]: tensor\(6,\) bfloat16 vs tensor\(7,\) bfloat16",
    ):
        write_torch_file(_state(), tmp_path / "rank_0.pt")


class _CountingSha256:
    """hashlib.sha256, counting every byte it is given (in ``hashed``, shared by every hasher made)."""

    hashed = 0
    _real = hashlib.sha256

    def __init__(self, data: bytes = b"") -> None:
        self._h = _CountingSha256._real()
        self.update(data)

    def update(self, data) -> None:
        _CountingSha256.hashed += memoryview(data).nbytes
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def test_every_written_byte_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save_hashed's file digest and tensor digests come from one pass:
    the bytes hashed are the file's, plus one 65-byte line per piece."""
    from osdpipe.io import torchfile

    monkeypatch.setattr(torchfile, "BUFFER_BYTES", 2 * torchfile.BLOCK)  # many buffers, pieces cut across them
    monkeypatch.setattr(hashlib, "sha256", _CountingSha256)  # every sha256 osdpipe takes, wherever
    torch.manual_seed(0)
    osd = {"state": {i: {"step": torch.tensor(2.0), "exp_avg": torch.randn(1000 + i),
                         "exp_avg_sq": torch.rand(1000 + i)}
                     for i in range(5)},
           "param_groups": [{"lr": 0.1, "params": list(range(5))}]}  # fmt: skip
    _CountingSha256.hashed = 0
    file_digest, per_tensor = digest.save_hashed(osd, tmp_path / "rank_0.pt")
    size = (tmp_path / "rank_0.pt").stat().st_size
    assert _CountingSha256.hashed == size + 65 * len(file_digest.pieces), "a byte was hashed twice, or not at all"
    assert len(per_tensor) == 15 and file_digest == digest_by_hand(tmp_path / "rank_0.pt", list(file_digest.pieces))


def test_a_fingerprint_is_of_the_bytes_joined_and_changes_with_any_one_element() -> None:
    """What the roundtrip check compares within a run (a batch as read, the state it filled): equal for the same bytes
    however they are cut into pieces, and different when any one element of them is."""
    torch.manual_seed(0)
    whole = torch.randn(64)
    as_read = digest.pieces_fingerprint([whole])
    assert digest.pieces_fingerprint([whole[:10], whole[10:41], whole[41:]]) == as_read
    assert digest.pieces_fingerprint([whole.clone()]) == as_read
    assert len(as_read) == 32  # 128 bits, hex
    for i in range(whole.numel()):
        wrong = whole.clone()
        wrong.view(torch.int32)[i] ^= 1  # the lowest bit of one element
        assert digest.pieces_fingerprint([wrong[:10], wrong[10:]]) != as_read, i
    assert digest.pieces_fingerprint([whole[:63]]) != as_read  # one element missing
