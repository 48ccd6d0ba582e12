"""A rank file read back a part at a time (osdpipe.io.part_source): around the page cache where the filesystem takes
``O_DIRECT``, through it where it refuses it (at open, or at the read), the bytes as written either way; and a part
as a request body."""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import pytest
import torch

from osdpipe.io import torchfile
from osdpipe.io.part_source import PartBody, PartSource, part_buffer

PART = 5 << 20
SIZE = 3 * PART + 12345  # the last part ends mid-block


def _written(directory: Path) -> tuple[Path, bytes]:
    """A file as the save stage writes one (torchfile's DirectFile: O_DIRECT where the filesystem takes it)."""
    data = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)).numpy()
    path = directory / "rank_0.pt"
    with torchfile.written(path, sync=False) as out:
        out.write(data.tobytes())
    return path, data.tobytes()


def _refusing(monkeypatch, at: str) -> None:
    """A filesystem that refuses O_DIRECT: at ``open`` (tmpfs before Linux 6.6), or takes the flag and refuses the
    read (some network filesystems)."""
    import osdpipe.io.part_source as part_source

    real_open, real_preadv = os.open, os.preadv
    direct_fds: set[int] = set()

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT and at == "open":
            raise OSError(22, "Invalid argument")
        fd = real_open(path, flags, *args)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)  # a number is used again once closed
        return fd

    def refusing_preadv(fd, buffers, offset):
        if fd in direct_fds:
            raise OSError(22, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(part_source.os, "open", refusing_open)
    monkeypatch.setattr(part_source.os, "preadv", refusing_preadv)


@pytest.mark.parametrize("o_direct", ["taken", "refused at open", "refused at read"])
def test_every_part_reads_back_as_written_the_last_one_short(tmp_path: Path, o_direct: str, monkeypatch) -> None:
    path, data = _written(tmp_path)
    if o_direct != "taken":
        _refusing(monkeypatch, o_direct.removeprefix("refused at "))
    source = PartSource(path)
    assert source.direct is (o_direct != "refused at open")
    buffer = part_buffer(PART)
    for start in range(0, SIZE, PART):
        length = min(PART, SIZE - start)
        assert bytes(source.read_into(buffer, start, length)) == data[start : start + length], start
    assert source.read(PART, PART) == data[PART : 2 * PART]
    assert source.direct is (o_direct == "taken")
    source.close()


def test_a_read_off_a_block_boundary_still_reads_what_is_there(tmp_path: Path) -> None:
    """O_DIRECT reads whole blocks at aligned offsets; a part that starts elsewhere is read through the page cache."""
    path, data = _written(tmp_path)
    source = PartSource(path)
    assert bytes(source.read_into(part_buffer(PART), 1000, 70000)) == data[1000:71000]
    assert source.read(SIZE - 10, 10) == data[-10:]
    source.close()


def test_a_part_past_the_files_end_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path, _ = _written(tmp_path)
    source = PartSource(path)
    with pytest.raises(OSError, match=rf"{path} ends at byte {SIZE}, before the {SIZE + PART - 12345} written"):
        source.read_into(part_buffer(PART), 3 * PART, PART)
    source.close()


def test_a_part_body_is_read_as_views_of_the_part() -> None:
    """As botocore reads a body (chunks until ``b""``: its SHA-256, then its CRC32 from the start again) and aiohttp
    sends it: each read is a view of the buffer, never a copy, and the passes see the part's bytes."""
    buffer = bytearray(os.urandom(3 << 20))
    body = PartBody(memoryview(buffer)[5:])
    chunks = list(iter(lambda: body.read(1 << 20), b""))
    assert [len(c) for c in chunks] == [1 << 20, 1 << 20, (1 << 20) - 5]
    assert all(isinstance(c, memoryview) and c.obj is buffer for c in chunks), "views of the part's buffer"
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    assert digest.digest() == hashlib.sha256(buffer[5:]).digest()
    assert body.seek(0) == 0 and zlib.crc32(body.read()) == zlib.crc32(buffer[5:]) and body.read() == b""
    body.seek(len(buffer))  # past the end: reads nothing
    assert body.read(10) == b"" and body.tell() == len(buffer)
