"""A read-only file of a known size, read where its position is: what ``zipfile`` and ``torch.load`` take as a file.

Subclasses say how the bytes at :attr:`Seekable.pos` are read (``readinto``); this class keeps the position.
:class:`ViewFile` is the bytes of a buffer already in memory.
"""

from __future__ import annotations

import io


class Seekable(io.RawIOBase):
    """``size`` bytes, read from ``pos`` on; seeking past the end is allowed (a read there returns nothing)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos


class ViewFile(Seekable):
    """The bytes of ``view`` (a slice of a larger buffer, say), as a file, never copied whole: each read copies what
    it asks for, straight into the reader's buffer where it gives one (``torch.load`` into a tensor's storage, a
    store client into its socket's chunks).

    ``io.BytesIO`` shares a whole ``bytes`` but copies anything else (a ``memoryview`` slice of one) first: the slice
    of a fetched request that holds one item, or a page-aligned buffer a part was read into, would be copied whole
    before the first read.
    """

    def __init__(self, view: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(view).cast("B")
        super().__init__(len(self._view))

    def __len__(self) -> int:  # a request body's length, without a seek to its end
        return self.size

    def readinto(self, into) -> int:  # noqa: ANN001 - any writable buffer
        n = max(0, min(len(into), self.size - self.pos))
        into[:n] = self._view[self.pos : self.pos + n]
        self.pos += n
        return n
