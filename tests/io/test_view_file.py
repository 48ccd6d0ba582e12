"""``ViewFile``: the bytes of a buffer as a file, read as the readers osdpipe hands it to read it (a store client a
request body, ``torch.load`` a fetched item), equal to the bytes and never copied whole."""

from __future__ import annotations

import hashlib
import io
import os

import torch

from osdpipe.core.seekable import ViewFile


def test_a_request_body_reads_in_chunks_seeks_back_and_says_its_length() -> None:
    """As botocore and aiohttp use a request body: its length, the digest of its chunks, then again from the start
    (a retry), then sent in chunks."""
    data = os.urandom(3 << 20)
    body = ViewFile(memoryview(data))
    assert len(body) == len(data) and body.tell() == 0
    digest = hashlib.sha256()
    for chunk in iter(lambda: body.read(1 << 20), b""):
        digest.update(chunk)
    assert digest.digest() == hashlib.sha256(data).digest()
    assert body.seek(0) == 0 and body.read(10) == data[:10]
    assert body.seek(-5, io.SEEK_END) == len(data) - 5 and body.read() == data[-5:]
    body.seek(0)
    assert b"".join(iter(lambda: body.read(256 << 10), b"")) == data


def test_torch_loads_an_item_from_a_slice_of_a_larger_fetch() -> None:
    """A DCP item is a ``torch.save`` archive of its own; fetched with its neighbours as one request, it is the
    slice of that request's bytes which ``torch.load`` reads, its storage filled from the slice itself."""
    saved = []
    for seed in range(3):
        torch.manual_seed(seed)
        buffer = io.BytesIO()
        torch.save(torch.randn(300, 7), buffer)
        saved.append(buffer.getvalue())
    fetched = b"".join(saved)  # three items side by side, as one ranged GET returns them
    at = 0
    for seed, item in enumerate(saved):
        torch.manual_seed(seed)
        want = torch.randn(300, 7)
        got = torch.load(ViewFile(memoryview(fetched)[at : at + len(item)]), weights_only=True)
        assert torch.equal(got, want), seed
        at += len(item)


def test_the_view_is_its_buffer_not_a_copy() -> None:
    """A change to the buffer is what the file reads next (it holds no copy of its own)."""
    buffer = bytearray(b"abcdef")
    file = ViewFile(memoryview(buffer)[2:5])
    buffer[3] = ord("X")
    assert file.read() == b"cXe" and len(file) == 3
