"""A read-only file of a known size, read where its position is: what ``zipfile`` and ``torch.load`` take as a file.

Subclasses say how the bytes at :attr:`Seekable.pos` are read (``readinto``); this class keeps the position.
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
