"""osdpipe's own writer of ``torch.save`` files (:mod:`osdpipe.io.torchfile`): torch, osdpipe's safe reader and
``zipfile`` read what it writes.

Fast: small objects, no processes. ZIP64's structures are exercised on small
files by lowering the size from which the writer uses them; the digests are
those of the bytes on disk; the file depends on its content only; and both
ways of writing (around the page cache, and through it where a filesystem
refuses ``O_DIRECT``) give the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import digest_by_hand

from osdpipe.core.compare import diff
from osdpipe.io import torchfile
from osdpipe.io.formats.safe_load import check_torch_zip


def _state() -> dict:
    torch.manual_seed(0)
    base = torch.randn(6, 10)
    return {
        "state": {
            0: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.randn(5000),
                "exp_avg_sq": base[:, ::2],  # a strided view of a bigger storage
            },
            1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(7).to(torch.bfloat16), "exp_avg_sq": torch.empty(0)},
            2: {
                "mask": torch.tensor([True, False, True]),
                "count": torch.arange(5),
                "half": torch.ones(3, dtype=torch.float16),
            },
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2], "name": "ünïcode"}],
        "shared": (base, base[1]),  # two tensors of one storage: one record
        "dtensor": {0: {"mesh": [2], "placements": ["S(0)"]}},
    }


@pytest.mark.parametrize("direct", [True, False])
def test_torch_loads_what_it_writes_plainly_and_memory_mapped(tmp_path: Path, direct: bool) -> None:
    path = tmp_path / "rank_0.pt"
    osd = _state()
    digest, storages = torchfile.save(osd, path, direct=direct)
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert diff(loaded, osd) == [], mmap
        assert loaded["shared"][1].untyped_storage().data_ptr() == loaded["shared"][0].untyped_storage().data_ptr()
    assert digest == digest_by_hand(path, list(digest.pieces))
    exp_avg = osd["state"][0]["exp_avg"]
    assert storages[exp_avg.untyped_storage()._cdata] == hashlib.sha256(exp_avg.numpy().tobytes()).hexdigest()
    with open(path, "rb") as f:
        # osdpipe's own reader: structure, alignment, the small records' CRC
        check_torch_zip(f, path.stat().st_size, str(path))
    with zipfile.ZipFile(path) as archive:
        names = [i.filename for i in archive.infolist()]
        assert names[0] == "archive/data.pkl" and names[-2:] == ["archive/version", "archive/.data/serialization_id"]
        assert archive.read("archive/version") == b"3\n" and archive.read("archive/byteorder") == b"little"
        for info in archive.infolist():
            data_start = info.header_offset + 30 + len(info.filename) + len(_local_extra(path, info))
            assert data_start % torchfile.ALIGNMENT == 0, info.filename


def _local_extra(path: Path, info: zipfile.ZipInfo) -> bytes:
    raw = path.read_bytes()[info.header_offset : info.header_offset + 30]
    name_length, extra_length = int.from_bytes(raw[26:28], "little"), int.from_bytes(raw[28:30], "little")
    start = info.header_offset + 30 + name_length
    return path.read_bytes()[start : start + extra_length]


def test_the_same_object_gives_the_same_bytes_either_way_of_writing(tmp_path: Path) -> None:
    torchfile.save(_state(), tmp_path / "a.pt", direct=True)
    torchfile.save(_state(), tmp_path / "b.pt", direct=False)
    torchfile.save(_state(), tmp_path / "c.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes() == (tmp_path / "c.pt").read_bytes()


def test_zip64_records_offsets_and_end_records_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the writer's ZIP64 threshold at 100 bytes, every large record,
    every late offset and the end records take ZIP64's forms."""
    monkeypatch.setattr(torchfile, "ZIP64_FROM", 100)
    path = tmp_path / "big.pt"
    osd = _state()
    torchfile.save(osd, path)
    assert (
        diff(torch.load(path, weights_only=True), osd) == []
        and diff(torch.load(path, weights_only=True, mmap=True), osd) == []
    )
    raw = path.read_bytes()
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw, "the ZIP64 end record and its locator"
    with zipfile.ZipFile(path) as archive:
        big = max(archive.infolist(), key=lambda i: i.file_size)  # exp_avg of 5000 floats
        assert big.file_size == 20000 and big.extra[:2] == b"\x01\x00", (
            "its central entry carries the ZIP64 extra field"
        )
        assert archive.read("archive/data.pkl")  # small records still read, their CRC checked
    with open(path, "rb") as f:
        check_torch_zip(f, path.stat().st_size, str(path))


def test_a_failure_while_writing_leaves_no_file(tmp_path: Path) -> None:
    class Unpicklable:
        def __reduce__(self):  # noqa: ANN204
            raise RuntimeError("cannot be saved")

    path = tmp_path / "rank_0.pt"
    with pytest.raises(RuntimeError, match="cannot be saved"):
        torchfile.save({"state": {0: {"exp_avg": torch.randn(10)}}, "bad": Unpicklable()}, path)
    assert not path.exists()
    path.write_bytes(b"x")
    with pytest.raises(FileExistsError):
        torchfile.save({"a": torch.ones(2)}, path)  # never over a file


def test_large_records_cross_buffer_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records larger than a buffer, and not a whole number of blocks, go out in pieces and come back whole."""
    monkeypatch.setattr(torchfile, "BUFFER_BYTES", 3 * torchfile.BLOCK)
    osd = {"a": torch.randn(10_001), "b": torch.arange(7, dtype=torch.int8), "c": torch.randn(3, 4097)}
    path = tmp_path / "x.pt"
    digest, _ = torchfile.save(osd, path)
    assert diff(torch.load(path, weights_only=True), osd) == [] and digest == digest_by_hand(path, list(digest.pieces))
    data = path.read_bytes()
    for name, value in osd.items():  # each storage record's data is a piece of its own: its digest the tensor's
        at = data.index(value.numpy().tobytes())
        assert at in {sum(digest.pieces[:i]) for i in range(len(digest.pieces))}, name
    assert torch.load(io.BytesIO(path.read_bytes()), weights_only=True)["c"].shape == (3, 4097)


def test_a_failure_while_finishing_the_file_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last write, the cut to length or the sync can fail too (a full disk): the file goes,
    as for a failure while writing."""
    import os

    def full_disk(fd: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "ftruncate", full_disk)
    path = tmp_path / "rank_0.pt"
    with pytest.raises(OSError, match="No space left"):
        torchfile.save({"a": torch.randn(100)}, path)
    assert not path.exists()
